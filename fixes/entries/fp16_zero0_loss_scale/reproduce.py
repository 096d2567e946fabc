"""How fp16-zero0-loss-scale is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from typing import Any, ContextManager


def reproduce() -> bool:
    """One fp16 ZeRO-0 SGD step against plain PyTorch (call inside :meth:`measurement_context` on
    CPU): True if the parameters differ beyond the fp16 tolerance."""
    from ...harness import Job, compare, train_deepspeed, train_reference

    job = Job(zero_stage=0, dtype="float16", optimizer="sgd", steps=1)
    return not compare(train_deepspeed(job).params, train_reference(job).params, "float16").close



def measurement_context() -> ContextManager[Any]:
    """fp16 on DeepSpeed's CPU accelerator for the check only (nothing on CUDA)."""
    from ...harness.precision import fp16_on_cpu

    return fp16_on_cpu()


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=0, dtype="float16", optimizer="sgd")


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): fp16 without ZeRO, then ZeRO-1 and fp32 instead (bf16 without
    ZeRO has a bug of its own, entry bf16-zero0-grads-never-zeroed); each cell one SGD step against plain PyTorch in
    its dtype's tolerance."""
    from ...harness import Cell, Job, compare, train_deepspeed, train_reference, trigger_job

    def cell(label: str, job: Job, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job),
                    lambda: not compare(train_deepspeed(job).params, train_reference(job).params, job.dtype).close, flips)

    base = Job(zero_stage=0, dtype="float16", optimizer="sgd", steps=1)
    return [cell("fp16, ZeRO stage 0", base),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("fp32 instead", base.with_(dtype="float32"), "precision")]
