"""How zero12-flat-buffer-detach is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. The notebook runs the user's script, ``harness.data_parallel_script``, on two ranks."""
from __future__ import annotations


def reproduce() -> bool:
    """Build a one-rank ZeRO-1 engine and look at its flat fp32/bf16 buffer: an autograd graph on
    it (``grad_fn``) is what makes two ranks fail at the first step."""
    from ...harness import Job, build_engine

    optimizer = build_engine(Job(zero_stage=1)).optimizer
    return any(buffer.grad_fn is not None for buffer in optimizer.bit16_groups_flat)


def first_step_fails(job, world_size: int) -> bool:
    """``job`` (one step of the harness's training loop) on ``world_size`` ranks, each on its own shard of the
    data: True if a rank fails with this bug's in-place error ("... is a view and is being modified inplace"),
    False if every rank trains; raises CannotTellError where a rank fails otherwise."""
    from ...exceptions import CannotTellError, RankFailedError
    from ...harness import launch, run_job

    try:
        launch(run_job, world_size, job)
    except RankFailedError as error:
        if "is a view and is being modified inplace" in error.message:
            return True
        raise CannotTellError(f"{error.exc_type}: {error.message[:200]}") from error
    return False


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ZeRO-1 on two ranks, then each condition flipped on its own
    (ZeRO stage 0, one rank); each cell trains one step of the user's loop, fp32, and tells whether a rank raises
    the in-place error. ZeRO-2 on two ranks meets every condition too: a second cell with them all."""
    from ...harness import Cell, Job, trigger_job

    def cell(label: str, job: Job, world_size: int, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, world_size), lambda: first_step_fails(job, world_size), flips)

    base = Job(zero_stage=1, steps=1)
    return [cell("ZeRO-1, two ranks", base, 2),
            cell("ZeRO-2, two ranks", base.with_(zero_stage=2), 2),
            cell("ZeRO stage 0 instead", base.with_(zero_stage=0), 2, "zero_stage"),
            cell("one rank", base, 1, "world_size")]
