"""How zero-grad-hook-lifetime is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

import contextlib
import gc
from typing import Any, ContextManager

from . import simulate_torch_before_2_1, torch_before_2_1, torch_branch

__all__ = ["reproduce", "measurement_context", "simulate_torch_before_2_1", "torch_before_2_1", "torch_branch"]

# The trigger's grid runs on real PyTorch 2.0.1 (``python -m ci.sweep.triggers`` reads this; ci/environments.toml).
TRIGGER_ENVIRONMENT = "torch-2.0"


def reproduce() -> bool:
    """One ZeRO-2 forward and backward (inside :meth:`measurement_context` for the torch < 2.1
    branch), counting the calls of the method ZeRO's gradient hook makes (``process_gradients``;
    ``reduce_ready_partitions_and_remove_grads`` before 0.16.6):
    True if no hook fired."""
    from ...harness import Job, build_engine, device, make_batches, mse

    job = Job(zero_stage=2)
    engine = build_engine(job)
    optimizer, calls = engine.optimizer, []
    hooked = "process_gradients" if hasattr(optimizer, "process_gradients") else "reduce_ready_partitions_and_remove_grads"
    original = getattr(optimizer, hooked)
    optimizer.__dict__[hooked] = lambda *args, **kwargs: (calls.append(1), original(*args, **kwargs))[1]
    x, y = make_batches(job.model, 1, micro_batch=job.micro_batch).micro(0, 0, 0)
    # Some releases leave the nodes in reference cycles, so they die at the next garbage
    # collection instead of at once; a training loop reaches one soon, the check forces it.
    gc.collect()
    try:
        engine.backward(mse(engine(x.to(device())), y.to(device())))
    except IndexError:  # the empty IPG bucket: the symptom when no hook fired
        pass
    return not calls


def measurement_context() -> ContextManager[None]:
    """The conditions the bug is measured under: the running torch as it is where it is older than 2.1
    (PyTorch 2.0.1 in the ``torch-2.0`` environment), else DeepSpeed's pre-2.1 branch selected by
    :func:`simulate_torch_before_2_1`. Prints which (the probe's evidence says it too)."""
    if torch_before_2_1():
        print(f"zero-grad-hook-lifetime: {torch_branch()} < 2.1: DeepSpeed's own pre-2.1 branch, no simulation")
        return contextlib.nullcontext()
    print(f"zero-grad-hook-lifetime: {torch_branch()} ≥ 2.1: DeepSpeed's pre-2.1 branch selected by "
          "simulate_torch_before_2_1()")
    return simulate_torch_before_2_1()


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def step_goes_wrong(job: Any) -> bool:
    """:func:`reproduce`'s check for any one-rank ``job``, followed through to the optimizer step: one forward,
    ``engine.backward`` and ``engine.step()``. True if ``engine.backward`` raises the empty IPG bucket's IndexError,
    or the engine has ZeRO's gradient hook method and no hook called it, or the weights after the step differ from
    plain PyTorch's (a job whose engine has no such hook, ZeRO stage 0 in fp32, is told by this last)."""
    from ...harness import build_engine, compare, device, gathered_params, make_batches, mse, train_reference

    engine = build_engine(job)
    optimizer, calls = engine.optimizer, []
    hooked = next((name for name in ("process_gradients", "reduce_ready_partitions_and_remove_grads")
                   if hasattr(optimizer, name)), None)
    if hooked is not None:
        original = getattr(optimizer, hooked)
        optimizer.__dict__[hooked] = lambda *args, **kwargs: (calls.append(1), original(*args, **kwargs))[1]
    x, y = make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch,
                        job.data_seed).micro(0, 0, 0)
    gc.collect()  # as reproduce(): nodes left in reference cycles die here
    try:
        engine.backward(mse(engine(x.to(device())), y.to(device())))
    except IndexError:  # the empty IPG bucket: the symptom when no hook fired
        return True
    if hooked is not None and not calls:
        return True
    engine.step()
    return not compare(gathered_params(engine.module), train_reference(job).params, job.dtype).close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), on real PyTorch 2.0.1 (:data:`TRIGGER_ENVIRONMENT`), each cell
    :func:`step_goes_wrong` (one SGD step): ZeRO-2 (the sweep's job), ZeRO-1, and ZeRO stage 0 (no ZeRO gradient
    hooks). Not in the grid: torch 2.1 or newer (this environment has PyTorch 2.0.1 only: the torch condition
    cannot be flipped here; where torch has ``register_post_accumulate_grad_hook`` DeepSpeed uses it, the sweep's
    rows in the default environment); ZeRO-3 (this release builds no ZeRO-3 engine on torch 2.0: it needs
    ``torch.compiler``); bf16 (the BF16 optimizer uses the same helper, but torch 2.0's gloo cannot broadcast
    bfloat16, so no bf16 engine is built on CPU)."""
    from ...harness import Cell, Job, trigger_job

    base = Job(zero_stage=2, steps=1)
    return [Cell("ZeRO-2, PyTorch 2.0.1", trigger_job(base), lambda: step_goes_wrong(base)),
            Cell("ZeRO-1 instead", trigger_job(base.with_(zero_stage=1)),
                 lambda: step_goes_wrong(base.with_(zero_stage=1)), "zero_stage"),
            Cell("ZeRO stage 0 instead", trigger_job(base.with_(zero_stage=0)),
                 lambda: step_goes_wrong(base.with_(zero_stage=0)), "zero_stage")]
