"""How zero3-gathered-params-cpu-race is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations


def reproduce() -> bool:
    """Two ranks train a ZeRO-3 TinyMLP for 200 steps, gathering the whole model after each step
    all at once and one parameter at a time (no fix applied), up to three times. True if any
    all-at-once gather differs from the one-at-a-time gather on any rank (measured on 0.18.9: 12
    and 17 of 200 in the first attempt)."""
    from .gathering import gather_job, run_until_corrupt

    return any(run.corrupt for run in run_until_corrupt(gather_job())[-1])
