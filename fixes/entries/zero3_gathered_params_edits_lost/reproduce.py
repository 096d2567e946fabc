"""How zero3-gathered-params-edits-lost is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe. The runs themselves are in ``edits.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def _verdict(result: Any, dtype: str) -> bool:
    """True where an edit was lost without an error (and training then differs from plain PyTorch trained from the
    loaded weights); False where every rank raised upstream's error on every edit, or the edits took effect and
    training matches. CannotTellError where the signs disagree."""
    from ...harness import compare

    if result.raised:
        return False
    if any(any(errors) for errors in result.errors):
        raise CannotTellError(f"some edits raised, some did not: {result}")
    lost = bool(result.silently_lost)
    differs = not (compare(result.losses, result.reference_losses, dtype, "losses").close
                   and compare(result.params, result.reference_params, dtype, "params").close)
    if lost != differs:
        raise CannotTellError(f"the edits were {'lost' if lost else 'kept'} but training "
                              f"{'differs from' if differs else 'matches'} plain PyTorch: {result}")
    return lost


def reproduce() -> bool:
    """Two ranks, ZeRO-3, the model built inside ``zero.Init``: load other weights with each of ``edits.EDITS``
    (``model.load_state_dict`` and ``param.data.copy_``) inside ``GatheredParameters`` without ``modifier_rank``, then
    train three steps. True if the loaded weights are gone after the block, no error was raised, and training differs
    from plain PyTorch trained from the loaded weights (beyond ``TOLERANCES``). One launch of two ranks."""
    from .edits import edit_job, run

    job = edit_job()
    return _verdict(run(job), job.dtype)


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trains_wrong(job: Any, modifier_rank: int | None = None) -> bool:
    """:func:`reproduce`'s check for ``job`` (two ranks), the edits done with ``modifier_rank``."""
    from .edits import run

    return _verdict(run(job, modifier_rank=modifier_rank), job.dtype)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), two ranks, each cell :func:`trains_wrong`: ZeRO-3 with the
    model built inside ``zero.Init`` and the weights loaded inside ``GatheredParameters`` without ``modifier_rank``
    (the sweep's check); the same load with ``modifier_rank=0`` (the documented way: the edit is broadcast and kept);
    and ZeRO-2 with the same code (``GatheredParameters`` leaves ordinary parameters alone: the model is built without
    ``zero.Init``, which is ZeRO-3's)."""
    from ...harness import Cell, trigger_job
    from .edits import edit_job

    base = edit_job()
    zero2 = base.with_(zero_stage=2, zero3_init=False, config={"zero_optimization": {"stage": 2}})

    def cell(label: str, job: Any, uses: tuple[str, ...], modifier_rank: int | None, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, 2, uses=uses), lambda: trains_wrong(job, modifier_rank), flips)

    return [cell("ZeRO-3, weights loaded inside GatheredParameters without modifier_rank", base,
                 ("gathered-edit",), None),
            cell("the same load with modifier_rank=0", base, (), 0, "uses:gathered-edit"),
            cell("ZeRO-2 instead, the same code", zero2, ("gathered-edit",), None, "zero_stage")]
