"""How warmup-cosine-lr-param-groups is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: :data:`SCHEDULER` (the config's ``"scheduler"`` section), :func:`job` and
:func:`multipliers`, WarmupCosineLR's documented formula for ``torch.optim.lr_scheduler.LambdaLR``.
"""
from __future__ import annotations

import math
from typing import Callable

TOTAL_STEPS, WARMUP_STEPS = 10, 4
WARMUP_MIN_RATIO, COS_MIN_RATIO = 0.0, 1e-4
GROUP_LRS = (1e-2, 1e-2)  # weight decay / no weight decay, the same base LR: Hugging Face Trainer's split
SCHEDULER = {"type": "WarmupCosineLR", "params": {"total_num_steps": TOTAL_STEPS, "warmup_num_steps": WARMUP_STEPS,
                                                  "warmup_min_ratio": WARMUP_MIN_RATIO,
                                                  "cos_min_ratio": COS_MIN_RATIO, "warmup_type": "log"}}


def job(steps: int = 8, zero_stage: int = 0, fixes: tuple[str, ...] = ()):
    from ...harness.schedules import ScheduledJob

    return ScheduledJob(SCHEDULER, GROUP_LRS, steps=steps, zero_stage=zero_stage, fixes=fixes)


def ratio(iteration: int) -> float:
    """WarmupCosineLR's documented LR ratio at ``iteration`` (DeepSpeed's ``last_batch_iteration``, 0 at its
    first ``step()``): log warm-up from warmup_min_ratio to 1 over the warm-up steps, then cosine decay to
    cos_min_ratio at total_num_steps."""
    if iteration < WARMUP_STEPS:
        return WARMUP_MIN_RATIO + math.log(iteration + 1) / math.log(WARMUP_STEPS) * (1 - WARMUP_MIN_RATIO)
    done = (iteration - WARMUP_STEPS + 1) / (TOTAL_STEPS - WARMUP_STEPS)
    return max(0.0, COS_MIN_RATIO + (1 - COS_MIN_RATIO) * (1 + math.cos(math.pi * done)) / 2)


def multiplier(steps_taken: int) -> float:
    """A group's LR as a multiple of its base LR at optimizer step ``steps_taken`` (the number of
    ``scheduler.step()`` calls so far): 0 before the scheduler's first step (what ``deepspeed.initialize`` sets),
    then the ratio of the iteration each ``engine.step()`` moved to."""
    return 0.0 if steps_taken == 0 else ratio(steps_taken - 1)


def multipliers(groups: int = len(GROUP_LRS)) -> list[Callable[[int], float]]:
    """One function per group for ``LambdaLR``: every group follows the same schedule."""
    return [multiplier] * groups


def reproduce() -> bool:
    """The user's job through ``deepspeed.initialize`` (WarmupCosineLR from the config, two parameter groups,
    AdamW), two steps: True if the first step ran a group at a non-zero LR where the schedule says 0."""
    from ...harness.schedules import train_deepspeed_scheduled

    run = train_deepspeed_scheduled(job(steps=2))
    return any(lr != 0.0 for lr in run.lrs[0])
