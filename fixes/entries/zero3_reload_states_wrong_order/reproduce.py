"""How zero3-reload-states-wrong-order is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe. The user's script and its reference are in ``offload.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """The user's loop on one rank, fp32: ZeRO-3, DeepSpeed's AdamW over the weight-decay / no-decay groups,
    ``engine.offload_states()`` and ``engine.reload_states()`` between the training steps. True if it trains
    differently from plain PyTorch (beyond ``TOLERANCES``); CannotTellError if the run fails. False where the engine
    has no ``offload_states`` (0.15.1 and older): the user's loop cannot call it, so nothing trains wrong."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from .offload import SPLIT, job

    if not hasattr(DeepSpeedEngine, "offload_states"):  # 0.15.1 and older: the loop cannot be written, no wrong result
        return False
    return bug_shows(job(), SPLIT)


def bug_shows(job: Any, groups: str) -> bool:
    """:func:`reproduce`'s check of ``job`` with ``groups`` (:data:`~.offload.SPLIT` or
    :data:`~.offload.ONE_GROUP`), next to its plain-PyTorch reference."""
    from .offload import run

    outcome = run(job, groups)
    if outcome.error is not None:
        raise CannotTellError(f"{outcome.label}: the run failed: {outcome.error_line[:300]}")
    return not outcome.matches


def zero2_refused(job: Any) -> bool:
    """The trigger grid's ZeRO-2 cell: the same loop under ZeRO-2. ``engine.offload_states()`` is ZeRO-3's API
    only (the engine asserts "supported only for ZeRO stage 3"), so there is nothing to reload: False where it
    refuses so, or where the run trains as plain PyTorch does; True where it trains differently."""
    from .offload import SPLIT, ZERO3_ONLY, run

    outcome = run(job, SPLIT)
    if outcome.error is not None:
        if outcome.error.exc_type == "AssertionError" and ZERO3_ONLY in outcome.error.message:
            return False
        raise CannotTellError(f"ZeRO-2: the run failed with another error: {outcome.error_line[:300]}")
    return not outcome.matches


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell the sweep's check (one rank, fp32, three AdamW
    steps with ``engine.offload_states()`` / ``engine.reload_states()`` between them, against plain PyTorch):
    ZeRO-3 with the weight-decay / no-decay groups; the same with every parameter in one group; ZeRO-2
    instead, where the engine refuses ``offload_states`` (it is ZeRO-3's API), which the cell records as the
    bug not showing."""
    from ...harness import Cell, trigger_job
    from .offload import ONE_GROUP, SPLIT, job

    base = job()
    zero2 = job(zero_stage=2)
    return [Cell("ZeRO-3, weight-decay / no-decay groups, offload_states + reload_states between steps",
                 trigger_job(base, 1, uses=("param-groups",)), lambda: bug_shows(base, SPLIT)),
            Cell("all parameters in one group instead", trigger_job(base, 1), lambda: bug_shows(base, ONE_GROUP),
                 "uses:param-groups"),
            Cell("ZeRO-2 instead (engine.offload_states refuses: ZeRO-3 only)", trigger_job(zero2, 1, uses=("param-groups",)),
                 lambda: zero2_refused(zero2), "zero_stage")]
