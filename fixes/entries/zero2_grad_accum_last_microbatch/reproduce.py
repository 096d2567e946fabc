"""How zero2-grad-accum-last-microbatch is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations


def reproduce() -> bool:
    """ZeRO-2 with 2 micro-batches, one step, against plain PyTorch: True if they differ beyond the fp32 tolerance."""
    from ...harness import Job, versus_reference

    return not versus_reference("sweep", Job(zero_stage=2, micro_steps=2, steps=1)).close


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=2, micro_steps=4)
