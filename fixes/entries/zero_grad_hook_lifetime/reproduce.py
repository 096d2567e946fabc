"""How zero-grad-hook-lifetime is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

import contextlib
import gc
from typing import ContextManager

from . import simulate_torch_before_2_1, torch_before_2_1, torch_branch

__all__ = ["reproduce", "measurement_context", "simulate_torch_before_2_1", "torch_before_2_1", "torch_branch"]


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
