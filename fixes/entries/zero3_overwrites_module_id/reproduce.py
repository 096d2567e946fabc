"""How zero3-overwrites-module-id is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe. The model and runs are in ``experts.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """ZeRO-3 on one rank, fp32, two SGD steps, every parameter released after use: the two-expert model whose
    experts keep their index in ``self.id``. True if an expert's ``id`` is not the user's value after
    ``deepspeed.initialize``, or the model trains differently from plain PyTorch (beyond ``TOLERANCES``);
    CannotTellError if the run fails."""
    from .experts import job

    return bug_shows(job())


def bug_shows(job: Any) -> bool:
    """:func:`reproduce`'s check of ``job``: the attribute model on one launched rank, next to its plain-PyTorch
    reference."""
    from .experts import ATTRIBUTE, run

    outcome = run(job, ATTRIBUTE)
    if outcome.error is not None:
        raise CannotTellError(f"the run failed: {outcome.error_line[:300]}")
    return outcome.shows_bug


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`bug_shows` (the sweep's check: the
    two-expert model whose experts keep their index in ``self.id``, one rank, fp32, two SGD steps, against plain
    PyTorch): ZeRO-3, then ZeRO-2 and ZeRO-1 instead (the same config and model). The model without an ``id``
    attribute is no cell: the trigger cannot read a model's attributes from its config (the note says it), and
    without one there is nothing for ZeRO-3 to overwrite."""
    from ...harness import Cell, trigger_job
    from .experts import job

    base = job()
    cells = [Cell("ZeRO-3, experts that keep their index in self.id", trigger_job(base, 1), lambda: bug_shows(base))]
    for stage in (2, 1):
        other = base.with_(zero_stage=stage, config={"zero_optimization": {"stage": stage}})
        cells.append(Cell(f"ZeRO-{stage} instead", trigger_job(other, 1),
                          lambda other=other: bug_shows(other), "zero_stage"))
    return cells
