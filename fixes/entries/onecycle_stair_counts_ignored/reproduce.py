"""How onecycle-stair-counts-ignored is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: :data:`SCHEDULER` (the config's ``"scheduler"`` section), :func:`job`,
:func:`documented`, the schedule the OneCycle documentation defines, and :func:`train_reference`, the same job in
plain PyTorch under that schedule.

OneCycle sets the momentum too (AdamW's beta1, with beta2 = 0.99), from the same scale factor as the LR, so the
plain-PyTorch reference sets both at every step. ``harness.schedules.train_reference_scheduled`` sets the LR only
(``LambdaLR``), hence :func:`train_reference` here.
"""
from __future__ import annotations

import math
from typing import Any

MIN_LR, MAX_LR = 1e-3, 1e-2
MIN_MOM, MAX_MOM = 0.85, 0.99
FIRST_STEPS, SECOND_STEPS = 4, 4  # the batches of the cycle's rising and falling halves
FIRST_STAIRS, SECOND_STAIRS = 2, 2  # stairs in each half: the LR holds for two batches, then jumps
STEPS = FIRST_STEPS + SECOND_STEPS + 1  # the whole cycle, back down to cycle_min_lr
BETA2 = 0.99  # OneCycle sets the optimizer's betas to (momentum, 0.99)
SCHEDULER = {"type": "OneCycle", "params": {
    "cycle_min_lr": MIN_LR, "cycle_max_lr": MAX_LR,
    "cycle_first_step_size": FIRST_STEPS, "cycle_first_stair_count": FIRST_STAIRS,
    "cycle_second_step_size": SECOND_STEPS, "cycle_second_stair_count": SECOND_STAIRS,
    "cycle_min_mom": MIN_MOM, "cycle_max_mom": MAX_MOM}}


def job(steps: int = STEPS, zero_stage: int = 0, fixes: tuple[str, ...] = (), scheduler: dict | None = None):
    from ...harness.schedules import ScheduledJob

    return ScheduledJob(scheduler or SCHEDULER, (MIN_LR, MIN_LR), steps=steps, zero_stage=zero_stage, fixes=fixes)


def scale(batch: int, stairs: bool = True) -> float:
    """OneCycle's position between its bounds at ``batch`` (the batches since the cycle started): rising from 0
    to 1 over ``cycle_first_step_size`` batches, falling back to 0 over ``cycle_second_step_size``. With a stair
    count above 0 ("lr/mom are changed in staircase fashion") each half is cut into that many stairs of equal
    length and the position holds at the value where the stair starts (the floor, as in the LR range test's
    staircase). ``stairs=False``: the continuous ramp, what a stair count of 0 means."""
    total = FIRST_STEPS + SECOND_STEPS
    offset = batch % total
    if offset <= FIRST_STEPS:
        count, done, length = FIRST_STAIRS, offset, FIRST_STEPS
    else:
        count, done, length = SECOND_STAIRS, total - offset, SECOND_STEPS
    if stairs and count > 0:
        return (done * count // length) / count
    return done / length


def documented(steps_taken: int, stairs: bool = True) -> tuple[float, float]:
    """The (LR, momentum) the optimizer uses at optimizer step ``steps_taken`` (the ``engine.step()`` calls so
    far), inside the cycle: ``cycle_min_lr`` and the initial momentum ``cycle_min_mom`` before the first step
    (``deepspeed.initialize`` sets them), then ``cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale`` and
    ``cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale`` of the batch each ``engine.step()`` moved to."""
    if steps_taken == 0:
        return MIN_LR, MIN_MOM
    position = scale(steps_taken, stairs)
    return MIN_LR + (MAX_LR - MIN_LR) * position, MAX_MOM - (MAX_MOM - MIN_MOM) * position


def train_reference(scheduled, stairs: bool = True):
    """``scheduled`` (a ``ScheduledJob``) in plain PyTorch: ``torch.optim.AdamW`` over the harness's two groups,
    each step's LR and betas set from :func:`documented` before the update, no DeepSpeed."""
    import torch

    from ...harness import TinyMLP, make_batches, mse
    from ...harness.schedules import ScheduledRun, param_groups

    model = TinyMLP(scheduled.job.model)
    optimizer = torch.optim.AdamW(param_groups(model, scheduled.group_lrs))
    batches = make_batches(scheduled.job.model, steps=scheduled.steps)
    lrs, losses = [], []
    for step in range(scheduled.steps):
        lr, momentum = documented(step, stairs)
        for group in optimizer.param_groups:
            group["lr"], group["betas"] = lr, (momentum, BETA2)
        lrs.append([lr for _ in optimizer.param_groups])
        x, y = batches.micro(step, 0, 0)
        loss = mse(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return ScheduledRun(lrs, {k: v.detach().cpu().numpy().copy() for k, v in model.named_parameters()}, losses)


def _matches(lrs: list[list[float]], stairs: bool) -> bool:
    return all(math.isclose(lr, documented(step, stairs)[0], rel_tol=1e-9)
               for step, step_lrs in enumerate(lrs) for lr in step_lrs)


def reproduce() -> bool:
    """The user's job through ``deepspeed.initialize`` (OneCycle from the config with two stairs per half, AdamW),
    one whole cycle: True if the LR ramps every batch (the continuous schedule, as if the stair counts were 0),
    False if it follows the staircase; CannotTellError if it follows neither."""
    from ...exceptions import CannotTellError
    from ...harness.schedules import train_deepspeed_scheduled

    lrs = train_deepspeed_scheduled(job()).lrs
    if _matches(lrs, stairs=True):
        return False
    if _matches(lrs, stairs=False):
        return True
    raise CannotTellError(f"OneCycle's LRs follow neither the staircase nor the continuous schedule: {lrs}")


LR_RANGE_TEST = {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": MIN_LR, "lr_range_test_step_size": 2,
                                                   "lr_range_test_step_rate": 1.0, "lr_range_test_staircase": True}}


def _without_stairs(scheduler: dict[str, Any]) -> dict[str, Any]:
    params = dict(scheduler["params"])
    if scheduler["type"] == "OneCycle":
        params.update(cycle_first_stair_count=0, cycle_second_stair_count=0)
    else:
        params.update(lr_range_test_staircase=False)
    return {**scheduler, "params": params}


def stairs_ignored(scheduled) -> bool:
    """The grid's check for any ``ScheduledJob`` whose scheduler asks for a staircase (OneCycle's stair counts,
    LRRangeTest's ``lr_range_test_staircase``): through ``deepspeed.initialize``, is the LR at every step the same
    as with the staircase turned off?"""
    from dataclasses import replace

    from ...harness.schedules import train_deepspeed_scheduled

    with_stairs = train_deepspeed_scheduled(scheduled).lrs
    without = train_deepspeed_scheduled(replace(scheduled, scheduler=_without_stairs(scheduled.scheduler))).lrs
    return with_stairs == without


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (OneCycle from the config with stair counts,
    AdamW), the same under ZeRO-2 (the scheduler steps the same torch optimizer), then LRRangeTest with its
    staircase instead of OneCycle. Each cell asks: does the schedule come out the same as with the staircase off?
    A cell with OneCycle's stair counts at 0 is not in the grid: the trigger reads the scheduler's type only (the
    stair counts are in its note), and with no stairs there is nothing for the bug to change."""
    from dataclasses import replace

    from ...harness import Cell, trigger_job

    base = job()

    def cell(label: str, scheduled, flips: str = "") -> Cell:
        return Cell(label, trigger_job(scheduled.config), lambda: stairs_ignored(scheduled), flips)

    return [cell("OneCycle with cycle_first/second_stair_count 2", base),
            cell("the same under ZeRO-2", replace(base, zero_stage=2)),
            cell("LRRangeTest with lr_range_test_staircase instead", replace(base, scheduler=LR_RANGE_TEST),
                 "scheduler")]
