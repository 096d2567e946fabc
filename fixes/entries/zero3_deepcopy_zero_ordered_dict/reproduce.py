"""How zero3-deepcopy-zero-ordered-dict is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe. The user's script is in ``copies.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """ZeRO-3 on one rank, fp32: ``deepspeed.initialize``, then ``copy.deepcopy(engine.module)`` inside
    ``deepspeed.zero.GatheredParameters`` (an EMA / reference copy). True if the copy raises this bug's
    TypeError from ``ZeROOrderedDict.__reduce__``, False if the copy is made and holds the engine's weights;
    CannotTellError if it fails another way or holds other weights."""
    from .copies import job

    return copy_fails(job())


def copy_fails(job: Any) -> bool:
    """:func:`reproduce`'s check of ``job`` (any ZeRO stage), one launched rank."""
    import numpy as np

    from .copies import run

    outcome = run(job)
    if outcome.error is not None:
        if outcome.bug_error:
            return True
        raise CannotTellError(f"the copy failed with another error: {': '.join(outcome.error)[:300]}")
    copied, before = outcome.result["copy"], outcome.result["before"]
    if sorted(copied) != sorted(before) or not all(np.array_equal(copied[k], before[k]) for k in before):
        raise CannotTellError("the copy was made but does not hold the engine's weights")
    return False


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`copy_fails` (the sweep's check: one rank,
    fp32, a deepcopy of the engine's module inside GatheredParameters): ZeRO-3, then ZeRO-2 instead (the same
    config and copy; ZeRO-2 leaves the modules' parameter dicts as they are). One rank, as the sweep's check:
    the rank count is no condition of this bug."""
    from ...harness import Cell, trigger_job
    from .copies import job, zero2_job

    base, zero2 = job(), zero2_job()
    return [Cell("ZeRO-3, copy.deepcopy(engine.module) after deepspeed.initialize", trigger_job(base, 1),
                 lambda: copy_fails(base)),
            Cell("ZeRO-2 instead", trigger_job(zero2, 1), lambda: copy_fails(zero2), "zero_stage")]
