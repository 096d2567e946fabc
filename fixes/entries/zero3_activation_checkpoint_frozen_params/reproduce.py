"""How zero3-activation-checkpoint-frozen-params is reproduced: the fast check the release sweep runs (``reproduce()``:
True where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix
or its probe. The model and runs are in ``checkpointed.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """ZeRO-3 on one rank, fp32, two SGD steps, every parameter released after use: the harness's TinyMLP with a
    frozen LayerNorm in front, norm and first layer under non-reentrant ``torch.utils.checkpoint``. True if the
    backward raises torch's checkpoint metadata error, trains differently from plain PyTorch (beyond
    ``TOLERANCES``) or leaves a parameter gathered after ``engine.backward``; CannotTellError if the run fails
    with another error."""
    from .checkpointed import NON_REENTRANT, job

    return bug_shows(job(), NON_REENTRANT)


def bug_shows(job: Any, variant: str) -> bool:
    """:func:`reproduce`'s check of ``job`` on ``variant`` (:data:`~.checkpointed.VARIANTS`)."""
    from .checkpointed import run

    outcome = run(job, variant)
    if outcome.error is not None:
        if outcome.bug_error:
            return True
        raise CannotTellError(f"{variant}: the run failed with another error: {outcome.error_line[:300]}")
    return not outcome.matches


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`bug_shows` (the sweep's check: one
    rank, fp32, two SGD steps, against plain PyTorch): ZeRO-3 with a frozen LayerNorm under non-reentrant
    checkpointing; then ZeRO-2 instead (the same config and model); then, with ZeRO-3, the two ways off the use:
    the same frozen norm without checkpointing, and the norm trainable under non-reentrant checkpointing. Every cell runs on one rank, as the sweep's check does: the rank count is no condition of this
    bug."""
    from ...harness import Cell, trigger_job
    from .checkpointed import NON_REENTRANT, TRAINABLE, UNCHECKPOINTED, job

    base = job()
    zero2 = base.with_(zero_stage=2, config={"zero_optimization": {**base.config["zero_optimization"], "stage": 2}})
    use = ("activation-checkpointing-frozen",)
    flip = "uses:activation-checkpointing-frozen"
    return [Cell("ZeRO-3, frozen LayerNorm under non-reentrant torch.utils.checkpoint",
                 trigger_job(base, 1, uses=use), lambda: bug_shows(base, NON_REENTRANT)),
            Cell("ZeRO-2 instead", trigger_job(zero2, 1, uses=use), lambda: bug_shows(zero2, NON_REENTRANT),
                 "zero_stage"),
            Cell("the same frozen LayerNorm without activation checkpointing", trigger_job(base, 1),
                 lambda: bug_shows(base, UNCHECKPOINTED), flip),
            Cell("the LayerNorm trainable (nothing frozen), non-reentrant checkpointing", trigger_job(base, 1),
                 lambda: bug_shows(base, TRAINABLE), flip)]
