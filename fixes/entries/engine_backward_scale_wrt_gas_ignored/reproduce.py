"""How engine-backward-scale-wrt-gas-ignored is reproduced: the fast check the release sweep runs (``reproduce()``:
True where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from typing import Any

USES = ("scale-wrt-gas-false",)  # what the user's loop does that its config cannot show


def base_job(**changes: Any):
    """The user's job: ZeRO-0, fp32, torch SGD (whose update is proportional to the gradient, so a gradient
    divided by gas shows in the weights), two micro-batches per step, two steps."""
    from ...harness import Job

    return Job(zero_stage=0, micro_steps=2, steps=2).with_(**changes)


def train_unscaled(job) -> Any:
    """``job`` through DeepSpeed with ``engine.backward(loss, scale_wrt_gas=False)`` for every micro-batch and
    ``engine.step()`` after each (DeepSpeed steps the optimizer at the accumulation boundary). Returns the
    gathered parameters (fp32 numpy) and the losses ``engine.backward`` returned."""
    from ...harness import build_engine, device, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    engine = build_engine(job)
    batches = make_batches(job.model, job.steps, job.micro_steps, 1, job.micro_batch, job.data_seed)
    returned = []
    for step in range(job.steps):
        for micro in range(job.micro_steps):
            x, y = batches.micro(step, micro, 0)
            loss = mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device()))
            returned.append(float(engine.backward(loss, scale_wrt_gas=False)))
            engine.step()
    return gathered_params(engine.module), returned


def reference_unscaled(job) -> Any:
    """Plain PyTorch for :func:`train_unscaled`: the micro-batches' gradients summed, not divided by gas (the
    harness's several-backwards job with gas=1 sums them over the same micro-batches)."""
    from ...harness import train_reference

    return train_reference(job.with_(micro_steps=1, backwards=job.micro_steps))


def versus_unscaled(job) -> Any:
    """(DeepSpeed parameters, plain-PyTorch parameters, their comparison) for :func:`train_unscaled`."""
    from ...harness import compare

    params, _ = train_unscaled(job)
    reference = reference_unscaled(job)
    return params, reference.params, compare(params, reference.params, job.dtype, "parameters, scale_wrt_gas=False")


def reproduce() -> bool:
    """engine.backward(loss, scale_wrt_gas=False) with gradient_accumulation_steps 2 against plain PyTorch that sums
    the micro-batches' gradients: True if the parameters differ beyond the fp32 tolerance."""
    return not versus_unscaled(base_job(steps=1))[2].close


def default_backward_differs(job) -> bool:
    """The same job with ``engine.backward(loss)`` (scale_wrt_gas left True) against plain PyTorch with each
    micro-loss divided by gas, as DeepSpeed documents: True if they differ."""
    from ...harness import compare, train_deepspeed, train_reference

    params = train_deepspeed(job).params
    return not compare(params, train_reference(job).params, job.dtype, "parameters, scale_wrt_gas=True").close


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix wraps engine.backward and the output
    hook on the training path)."""
    from ... import harness

    return harness.bench_job(micro_steps=2)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ZeRO-0, fp32, gradient_accumulation_steps 2 and
    ``engine.backward(loss, scale_wrt_gas=False)``, one step against plain PyTorch that sums the micro-batches'
    gradients; then gradient_accumulation_steps 1 (nothing to divide), and ``engine.backward(loss)`` with the
    default scale_wrt_gas=True against plain PyTorch that divides each micro-loss by gas."""
    from ...harness import Cell, trigger_job

    base = base_job(steps=1)
    return [Cell("gradient_accumulation_steps 2, engine.backward(loss, scale_wrt_gas=False)",
                 trigger_job(base, uses=USES), reproduce),
            Cell("gradient_accumulation_steps 1 instead", trigger_job(base.with_(micro_steps=1), uses=USES),
                 lambda: not versus_unscaled(base.with_(micro_steps=1))[2].close, "gradient_accumulation_steps"),
            Cell("engine.backward(loss), scale_wrt_gas left True", trigger_job(base),
                 lambda: default_backward_differs(base), "uses:scale-wrt-gas-false")]
