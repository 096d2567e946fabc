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
    AdamW), two steps: True if the first step ran one group at LR 0, as the schedule says, and another at a non-zero
    LR. (Releases that set no LR before the first step run every group at its base LR there: no group differs, not
    this bug.)"""
    from ...harness.schedules import train_deepspeed_scheduled

    run = train_deepspeed_scheduled(job(steps=2))
    return any(lr == 0.0 for lr in run.lrs[0]) and any(lr != 0.0 for lr in run.lrs[0])


# The WarmupLR scheduler over the same warm-up, its warmup_max_lr the groups' (equal) base LR, given explicitly:
# before its first step() it sets warmup_min_lr (0) in every group.
WARMUP_LR = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": GROUP_LRS[0],
                                            "warmup_num_steps": WARMUP_STEPS, "warmup_type": "log"}}


def first_step_lrs(scheduled, groups: int = 2) -> list:
    """The LR of every group at the first optimizer step of ``scheduled`` (a ``ScheduledJob``) through
    ``deepspeed.initialize``: the two groups of the harness (weights, biases), or with ``groups=1`` all the
    parameters in one group at the first group's LR."""
    import deepspeed
    import torch

    from ...harness import TinyMLP
    from ...harness.schedules import WEIGHT_DECAY, train_deepspeed_scheduled

    if groups == 2:
        return train_deepspeed_scheduled(scheduled).lrs[0]
    model = TinyMLP(scheduled.job.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=scheduled.group_lrs[0], weight_decay=WEIGHT_DECAY)
    deepspeed.initialize(model=model, optimizer=optimizer, config=scheduled.config)
    return [float(group["lr"]) for group in optimizer.param_groups]  # what the first engine.step() would use


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (WarmupCosineLR from the config, the
    weights' and the biases' groups at the same base LR, AdamW), then WarmupLR instead (the same log warm-up from
    0, its warmup_max_lr set to the groups' LR: with equal group LRs and an explicit warmup_max_lr it stays clear of
    warmup-lr-param-groups-max-lr), then all parameters in one group. Each cell is the sweep's check: does a group
    run the first optimizer step at a non-zero LR where the warm-up starts at 0?"""
    from dataclasses import replace

    from ...harness import Cell, trigger_job

    base = job(steps=2)

    def cell(label: str, scheduled, groups: int, uses: list, flips: str = "") -> Cell:
        return Cell(label, trigger_job(scheduled.config, uses=uses),
                    lambda: any(lr != 0.0 for lr in first_step_lrs(scheduled, groups)), flips)

    return [cell("WarmupCosineLR, two parameter groups", base, 2, ["param-groups"]),
            cell("WarmupLR instead", replace(base, scheduler=WARMUP_LR), 2, ["param-groups"], "scheduler"),
            cell("one parameter group", base, 1, [], "uses:param-groups")]
