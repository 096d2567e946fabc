"""How warmup-cosine-lr-zero-division is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: :data:`SCHEDULER` (the config's ``"scheduler"`` section, total_num_steps
equal to warmup_num_steps), :func:`job`, and :func:`multipliers`, the schedule the fixed releases define, for
``torch.optim.lr_scheduler.LambdaLR``.
"""
from __future__ import annotations

import math
from typing import Callable

WARMUP_STEPS = 4
TOTAL_STEPS = WARMUP_STEPS  # the whole run is warm-up: no cosine decay window
WARMUP_MIN_RATIO, COS_MIN_RATIO = 0.0, 0.1
GROUP_LRS = (1e-2, 1e-2)
SCHEDULER = {"type": "WarmupCosineLR", "params": {"total_num_steps": TOTAL_STEPS, "warmup_num_steps": WARMUP_STEPS,
                                                  "warmup_min_ratio": WARMUP_MIN_RATIO,
                                                  "cos_min_ratio": COS_MIN_RATIO, "warmup_type": "log"}}
# The sibling scheduler with the same warm-up and the same (empty) decay window: it floors its denominator.
WARMUP_DECAY_LR = {"type": "WarmupDecayLR", "params": {"total_num_steps": TOTAL_STEPS, "warmup_min_lr": 0.0,
                                                       "warmup_max_lr": GROUP_LRS[0],
                                                       "warmup_num_steps": WARMUP_STEPS, "warmup_type": "log"}}


def job(steps: int = WARMUP_STEPS + 2, zero_stage: int = 0, fixes: tuple[str, ...] = (), scheduler=None):
    from ...harness.schedules import ScheduledJob

    return ScheduledJob(scheduler or SCHEDULER, GROUP_LRS, steps=steps, zero_stage=zero_stage, fixes=fixes)


def ratio(iteration: int) -> float:
    """WarmupCosineLR's LR ratio at ``iteration`` (DeepSpeed's ``last_batch_iteration``, 0 at its first
    ``step()``) as the fixed releases define it: log warm-up from warmup_min_ratio to 1 over the warm-up steps,
    then a cosine decay over max(1, total - warmup) steps whose progress is clamped to 1, so that with no decay
    window every step after the warm-up runs at cos_min_ratio."""
    if iteration < WARMUP_STEPS:
        return WARMUP_MIN_RATIO + math.log(iteration + 1) / math.log(WARMUP_STEPS) * (1 - WARMUP_MIN_RATIO)
    progress = min(1.0, (iteration - WARMUP_STEPS + 1) / max(1, TOTAL_STEPS - WARMUP_STEPS))
    return max(0.0, COS_MIN_RATIO + (1 - COS_MIN_RATIO) * (1 + math.cos(math.pi * progress)) / 2)


def multiplier(steps_taken: int) -> float:
    """A group's LR as a multiple of its base LR at optimizer step ``steps_taken`` (the number of
    ``scheduler.step()`` calls so far): 0 before the scheduler's first step, then the ratio of the iteration each
    ``engine.step()`` moved to."""
    return 0.0 if steps_taken == 0 else ratio(steps_taken - 1)


def multipliers(groups: int = len(GROUP_LRS)) -> list[Callable[[int], float]]:
    return [multiplier] * groups


def crashes(scheduled) -> bool:
    """Train ``scheduled`` (a ``ScheduledJob``) through ``deepspeed.initialize``: True if ``engine.step()``
    raises ZeroDivisionError, False if every step runs."""
    from ...exceptions import CannotTellError
    from ...harness.schedules import train_deepspeed_scheduled

    try:
        train_deepspeed_scheduled(scheduled)
    except ZeroDivisionError:
        return True
    except Exception as exc:  # noqa: BLE001 - anything else says nothing about this bug
        raise CannotTellError(f"the scheduled job failed: {type(exc).__name__}: {exc}") from exc
    return False


def reproduce() -> bool:
    """The user's job through ``deepspeed.initialize`` (WarmupCosineLR from the config with total_num_steps equal
    to warmup_num_steps, AdamW), two steps past the warm-up: True if training raises ZeroDivisionError."""
    return crashes(job())


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (WarmupCosineLR, total_num_steps equal to
    warmup_num_steps), the same under ZeRO-2 (the scheduler steps the same torch optimizer), then WarmupDecayLR
    with the same warm-up and total instead. A cell with total_num_steps above warmup_num_steps is not in the
    grid: the trigger reads the scheduler's type only (the step counts are in its note). Each cell asks: does
    training raise ZeroDivisionError after the warm-up?"""
    from ...harness import Cell, trigger_job

    def cell(label: str, scheduled, flips: str = "") -> Cell:
        return Cell(label, trigger_job(scheduled.config), lambda: crashes(scheduled), flips)

    return [cell("WarmupCosineLR, total_num_steps == warmup_num_steps", job()),
            cell("the same under ZeRO-2", job(zero_stage=2)),
            cell("WarmupDecayLR instead", job(scheduler=WARMUP_DECAY_LR), "scheduler")]
