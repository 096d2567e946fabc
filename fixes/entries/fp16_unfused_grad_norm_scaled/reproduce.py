"""How fp16-unfused-grad-norm-scaled is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix of its own applied. Imported by the sweep, the tests and the notebook, never by
the fix or its probe."""
from __future__ import annotations

import contextlib
from typing import Iterator

# engine.backward without the fp16 loss scale (entry fp16-zero0-loss-scale) leaves the gradients unscaled, which
# hides this bug: its fix is applied for the measurement where that bug is installed, as this fix requires it.
MASKING_FIX = "fp16-zero0-loss-scale"


def job(dtype: str = "float16", **changes):
    """The user's job: fp16 without ZeRO, a torch optimizer (DeepSpeed wraps it in FP16_UnfusedOptimizer), a
    static loss scale of 128, two steps."""
    from ...harness import Job

    return Job(zero_stage=0, dtype=dtype, optimizer="sgd", steps=2).with_(**changes)


def grad_norms(job) -> tuple[list, list]:
    """(``engine.get_global_grad_norm()`` after each step, plain PyTorch's global L2 norm of the same gradients)."""
    from ...harness import train_deepspeed, train_reference

    return train_deepspeed(job).grad_norms, train_reference(job).grad_norms


def reproduce() -> bool:
    """Two fp16 ZeRO-0 SGD steps (inside :func:`measurement_context`): True if the gradient norm DeepSpeed reports
    differs from plain PyTorch's beyond the fp16 tolerance."""
    from ...exceptions import CannotTellError
    from ...harness import compare

    reported, reference = grad_norms(job())
    if any(norm is None for norm in reported):
        raise CannotTellError(f"the engine reported no gradient norm: {reported}")
    return not compare(reported, reference, "float16").close


@contextlib.contextmanager
def measurement_context() -> Iterator[None]:
    """fp16 on DeepSpeed's CPU accelerator (nothing on CUDA), and where entry fp16-zero0-loss-scale's bug is
    installed its fix, so that the gradients carry the loss scale as this optimizer expects."""
    from ...harness.entry import fixed_where_installed
    from ...harness.precision import fp16_on_cpu

    with fp16_on_cpu(), fixed_where_installed(MASKING_FIX):
        yield


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=0, dtype="float16", optimizer="sgd")


def shows(run) -> bool:
    """Whether the gradient norm the engine reports after some step differs from plain PyTorch's beyond the job's
    tolerance (an engine that reports none, e.g. a torch optimizer in fp32, does not show it)."""
    from ...harness import compare

    reported, reference = grad_norms(run)
    return any(norm is not None and not compare([norm], [ref], run.dtype).close
               for norm, ref in zip(reported, reference))


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): fp16 without ZeRO, then ZeRO-1 and fp32 instead; each
    cell two SGD steps, the reported gradient norm against plain PyTorch's in the dtype's tolerance (:func:`shows`)."""
    from ...harness import Cell, trigger_job

    def cell(label: str, run, flips: str = "") -> Cell:
        return Cell(label, trigger_job(run), lambda: shows(run), flips)

    base = job()
    return [cell("fp16, ZeRO stage 0, a torch optimizer", base),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("fp32 instead", base.with_(dtype="float32"), "precision")]
