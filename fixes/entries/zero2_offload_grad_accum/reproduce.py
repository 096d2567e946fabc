"""How zero2-offload-grad-accum is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations


def reproduce() -> bool:
    """ZeRO-2 with CPU offload and 3 micro-batches, one step, against plain PyTorch: True if they differ beyond the fp32 tolerance."""
    from ...harness import Job, versus_reference

    return not versus_reference("sweep", Job(zero_stage=2, offload=True, micro_steps=3, steps=1)).close


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=2, offload=True, micro_steps=4)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ZeRO-2 with CPU offload and three micro-batches, then each
    condition flipped on its own (ZeRO-1 with the same offload, no offload, two micro-batches: the first and the
    last, which are kept); each cell is the sweep's check (one step against plain PyTorch, fp32 tolerance).
    ZeRO-2 without offload on the reproduce release is clear of zero2-grad-accum-last-microbatch (fixed there)."""
    from ...harness import Cell, Job, trigger_job, versus_reference

    def cell(label: str, job: Job, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job), lambda: not versus_reference("trigger", job).close, flips)

    base = Job(zero_stage=2, offload=True, micro_steps=3, steps=1)
    return [cell("ZeRO-2, offload_optimizer to CPU, gradient_accumulation_steps 3", base),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("without offload_optimizer", base.with_(offload=False), "offload_optimizer"),
            cell("gradient_accumulation_steps 2", base.with_(micro_steps=2), "gradient_accumulation_steps")]
