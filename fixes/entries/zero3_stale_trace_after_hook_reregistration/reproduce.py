"""How zero3-stale-trace-after-hook-reregistration is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook,
never by the fix or its probe. The model, the user's script and the plain-PyTorch reference are in
``generation.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """Two ranks, ZeRO-3, fp32, three steps of the user's loop (generate inside ``unwrap_model_for_generation``,
    then train on the same prompts): True if the ranks raise this bug's ``IndexError: pop from an empty deque`` (from
    ``record_parameters``), False if the loop trains as plain PyTorch does (losses and weights, within
    ``TOLERANCES``), CannotTellError otherwise."""
    from .generation import job

    return bug_shows(job())


def bug_shows(job: Any, world_size: int | None = None) -> bool:
    """:func:`reproduce`'s check of ``job`` on ``world_size`` ranks (two by default). What was generated is not
    compared here: on CPU, releases with entry zero3-gathered-params-cpu-race's bug may read the gathered
    parameters before they land, which says nothing about this bug (the notebook compares it with the fix,
    which applies that entry's fix too)."""
    from .generation import WORLD_SIZE, run

    outcome = run(job, world_size or WORLD_SIZE)
    if outcome.error is not None:
        if outcome.bug_error:
            return True
        raise CannotTellError(f"the run failed with another error: {outcome.error_line[:300]}")
    if outcome.trains_like_pytorch(completions=False):
        return False
    raise CannotTellError("no error, but training differs from plain PyTorch: "
                          + "; ".join(str(c) for c in outcome.comparisons(completions=False)))


USES = ("hooks-reregistered",)  # what the user's loop does that its config cannot show


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`bug_shows`: the sweep's job (ZeRO-3, two
    ranks, fp32, generation inside ``unwrap_model_for_generation`` before each training step); the same in bf16;
    the same on one rank (the rank count is no condition); and ZeRO-2 instead, where the trainer's
    ``unwrap_for_generation`` (as TRL's) leaves the engine as it is: no hooks are removed or registered again.

    Not in the grid, because the trigger cannot read them (they are in its note): the same loop without
    generation (the hooks are never registered again), and generation that runs the outer module's forward (its
    start-of-forward hook stays registered and runs reset_step inside the block, before the ids change). Neither hits the bug; the trigger, which reads the ZeRO stage only, would call both hit."""
    from ...harness import Cell, trigger_job
    from .generation import WORLD_SIZE, job

    base = job()
    bf16 = job("bfloat16")
    zero2 = base.with_(zero_stage=2, config={"zero_optimization": {"stage": 2}})
    return [Cell("ZeRO-3, two ranks, fp32: generation inside unwrap_model_for_generation before every step",
                 trigger_job(base, WORLD_SIZE, USES), lambda: bug_shows(base)),
            Cell("the same in bf16", trigger_job(bf16, WORLD_SIZE, USES), lambda: bug_shows(bf16)),
            Cell("the same on one rank", trigger_job(base, 1, USES), lambda: bug_shows(base, 1)),
            Cell("ZeRO-2 instead (no hooks removed or registered again around generation)",
                 trigger_job(zero2, WORLD_SIZE, USES), lambda: bug_shows(zero2), "zero_stage")]
