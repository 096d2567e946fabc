"""How warmup-lr-param-groups-max-lr is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: :data:`SCHEDULER` (the config's ``"scheduler"`` section, without
``warmup_max_lr``), :func:`job` and :func:`multipliers`, the documented WarmupLR formula for
``torch.optim.lr_scheduler.LambdaLR``.
"""
from __future__ import annotations

import math
from typing import Callable

WARMUP_STEPS = 4
GROUP_LRS = (1e-2, 1e-1)  # the weights' group, and the biases' group at 10x (a per-group LR, as for a new head)
SCHEDULER = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_num_steps": WARMUP_STEPS,
                                            "warmup_type": "linear"}}  # no warmup_max_lr: each group's own LR


def job(steps: int = WARMUP_STEPS + 3, zero_stage: int = 0, fixes: tuple[str, ...] = ()):
    from ...harness.schedules import ScheduledJob

    return ScheduledJob(SCHEDULER, GROUP_LRS, steps=steps, zero_stage=zero_stage, fixes=fixes)


def gamma(iteration: int, warmup_steps: int = WARMUP_STEPS, warmup_type: str = "linear") -> float:
    """WarmupLR's documented warm-up fraction after ``iteration`` scheduler steps (DeepSpeed counts from
    ``last_batch_iteration = 0`` at its first ``step()``): log or linear from 0 to 1 over ``warmup_steps``, then 1."""
    if iteration >= warmup_steps:
        return 1.0
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


def multiplier(steps_taken: int) -> float:
    """The LR of a group, as a multiple of its own base LR (warmup_min_lr = 0), at optimizer step ``steps_taken``
    (the number of ``scheduler.step()`` calls so far): ``deepspeed.initialize`` sets warmup_min_lr before the first
    step, and each ``engine.step()`` then moves to the next iteration of the formula."""
    return 0.0 if steps_taken == 0 else gamma(steps_taken - 1)


def multipliers(groups: int = len(GROUP_LRS)) -> list[Callable[[int], float]]:
    """One function per group for ``LambdaLR``: every group warms up to its own LR, the same way."""
    return [multiplier] * groups


def reproduce() -> bool:
    """The user's job through ``deepspeed.initialize`` (WarmupLR from the config, two groups with their own
    LRs, AdamW): True if, once warmed up, every group trains at the first group's LR (the second one's is 10x)."""
    from ...harness.schedules import train_deepspeed_scheduled

    run = train_deepspeed_scheduled(job())
    warmed = run.lrs[-1]
    # Releases before PR #7360 warm every group up to the documented default 0.001 instead: not this bug.
    return all(math.isclose(lr, GROUP_LRS[0], rel_tol=1e-6) for lr in warmed)


TOTAL_STEPS = 100  # WarmupDecayLR's total_num_steps in the grid: it decays slowly after the warm-up


def warmed_to_first_groups_lr(scheduled) -> bool:
    """The sweep's check for any ``ScheduledJob``: through ``deepspeed.initialize``, once warmed up (the last
    step), does a group run at the first group's base LR where its own base LR is another?"""
    from ...harness.schedules import train_deepspeed_scheduled

    warmed, own = train_deepspeed_scheduled(scheduled).lrs[-1], scheduled.group_lrs
    return any(math.isclose(lr, own[0], rel_tol=1e-6) and not math.isclose(lr, base, rel_tol=1e-6)
               for lr, base in zip(warmed, own))


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (WarmupLR from the config without
    warmup_max_lr, the biases' group at 10x the weights' LR, AdamW, warmed up), then WarmupDecayLR instead (the
    same warm-up; its own default warmup_max_lr is 0.001, not the optimizer's LR), then ``warmup_max_lr`` set to
    the groups' LRs, then both groups at the same LR. Each cell is the sweep's check: does a group run at the first
    group's LR instead of its own once warmed up? WarmupDecayLR, not WarmupCosineLR, for the scheduler: with two
    parameter groups WarmupCosineLR has a bug of its own on this release (warmup-cosine-lr-param-groups)."""
    from dataclasses import replace

    from ...harness import Cell, trigger_job

    base = job()
    params = SCHEDULER["params"]

    def cell(label: str, scheduled, uses: list, flips: str = "") -> Cell:
        return Cell(label, trigger_job(scheduled.config, uses=uses), lambda: warmed_to_first_groups_lr(scheduled),
                    flips)

    both = ["param-groups", "param-group-lrs"]
    return [cell("WarmupLR without warmup_max_lr, groups at different LRs", base, both),
            cell("WarmupDecayLR instead", replace(base, scheduler={
                "type": "WarmupDecayLR", "params": {**params, "total_num_steps": TOTAL_STEPS}}), both, "scheduler"),
            cell("warmup_max_lr set to the groups' LRs", replace(base, scheduler={
                "type": "WarmupLR", "params": {**params, "warmup_max_lr": list(GROUP_LRS)}}), both, "warmup_max_lr"),
            cell("both groups at the same LR", replace(base, group_lrs=(GROUP_LRS[0], GROUP_LRS[0])),
                 ["param-groups"], "uses:param-group-lrs")]
