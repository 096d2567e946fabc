"""How onecycle-per-group-lists is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: :data:`SCHEDULER` (the config's ``"scheduler"`` section, with one value
per parameter group for each of OneCycle's four bounds), :func:`job`, :func:`train_deepspeed` (the user's loop,
recording each group's LR and beta1 before every step), :func:`documented` (the schedule the fixed release computes
for each group) and :func:`train_reference`, the same job in plain PyTorch under that schedule.

The harness's ``train_deepspeed_scheduled`` reads each group's LR as a number before every step, which an affected
release makes impossible (the LR is a list), hence :func:`train_deepspeed` here.
"""
from __future__ import annotations

import math
from typing import Any

# group 0: the weight matrices (weight decay), group 1: the biases (no weight decay)
MIN_LRS, MAX_LRS = [1e-3, 2e-3], [1e-2, 4e-2]
MIN_MOMS, MAX_MOMS = [0.85, 0.8], [0.99, 0.95]
FIRST_STEPS = 4  # the rising half of the cycle; the falling half is as long (cycle_second_step_size unset)
STEPS = 2 * FIRST_STEPS + 1  # the whole cycle, back down to cycle_min_lr
BETA2 = 0.99  # OneCycle sets each group's betas to (momentum, 0.99)
SCHEDULER = {"type": "OneCycle", "params": {
    "cycle_min_lr": MIN_LRS, "cycle_max_lr": MAX_LRS, "cycle_first_step_size": FIRST_STEPS,
    "cycle_min_mom": MIN_MOMS, "cycle_max_mom": MAX_MOMS}}
ERROR = "can't multiply sequence by non-int of type 'float'"  # torch AdamW: param.mul_(1 - lr * weight_decay)


def job(steps: int = STEPS, zero_stage: int = 0, fixes: tuple[str, ...] = (), scheduler: dict | None = None):
    from ...harness.schedules import ScheduledJob

    return ScheduledJob(scheduler or SCHEDULER, (MIN_LRS[0], MIN_LRS[1]), steps=steps, zero_stage=zero_stage,
                        fixes=fixes)


def scale(batch: int) -> float:
    """OneCycle's position between its bounds after ``batch`` scheduler steps, inside the first cycle: rising
    from 0 to 1 over ``cycle_first_step_size`` batches, then falling back to 0 over as many."""
    offset = batch % (2 * FIRST_STEPS)
    return offset / FIRST_STEPS if offset <= FIRST_STEPS else (2 * FIRST_STEPS - offset) / FIRST_STEPS


def documented(steps_taken: int, group: int) -> tuple[float, float]:
    """The (LR, beta1) group ``group`` uses at optimizer step ``steps_taken`` (the ``engine.step()`` calls so far):
    its own ``cycle_min_lr`` and ``cycle_min_mom`` before the first step, then
    ``cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale`` and ``cycle_max_mom - (cycle_max_mom - cycle_min_mom)
    * scale`` from its own bounds: what the fixed release computes per group."""
    if steps_taken == 0:
        return MIN_LRS[group], MIN_MOMS[group]
    position = scale(steps_taken)
    return (MIN_LRS[group] + (MAX_LRS[group] - MIN_LRS[group]) * position,
            MAX_MOMS[group] - (MAX_MOMS[group] - MIN_MOMS[group]) * position)


def _number(value: Any) -> Any:
    """A group's LR or beta1 as a float; a list (what an affected release stores) is kept as it is."""
    import torch

    if torch.is_tensor(value):
        return float(value.item())
    return value if isinstance(value, (list, tuple)) else float(value)


def train_deepspeed(scheduled) -> tuple[list[list[Any]], list[list[Any]], Any]:
    """The user's loop: ``deepspeed.initialize`` with a torch AdamW over the weight-decay / no-decay groups and
    ``scheduled.scheduler`` in the config, then ``engine.backward`` / ``engine.step``. Returns the LRs and the
    beta1s each group held before every step (``[step][group]``), and the engine. An affected release raises
    the optimizer's TypeError from the first ``engine.step()``."""
    import deepspeed
    import torch

    import fixes

    from ...harness import TinyMLP, device, make_batches, mse
    from ...harness.schedules import param_groups

    if scheduled.fixes:
        fixes.apply(*scheduled.fixes)
    model = TinyMLP(scheduled.job.model)
    optimizer = torch.optim.AdamW(param_groups(model, scheduled.group_lrs))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=scheduled.config)
    batches = make_batches(scheduled.job.model, steps=scheduled.steps)
    lrs, moms = [], []
    for step in range(scheduled.steps):
        lrs.append([_number(group["lr"]) for group in optimizer.param_groups])
        moms.append([_number(group["betas"][0]) for group in optimizer.param_groups])
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device())), y.to(device()))
        engine.backward(loss)
        engine.step()  # the optimizer step, then OneCycle's step
    return lrs, moms, engine


def train_reference(scheduled):
    """``scheduled`` in plain PyTorch: ``torch.optim.AdamW`` over the same two groups, each group's LR and betas
    set from :func:`documented` before every update, no DeepSpeed. Returns a ``ScheduledRun`` and the beta1s."""
    import torch

    from ...harness import TinyMLP, make_batches, mse
    from ...harness.schedules import ScheduledRun, param_groups

    model = TinyMLP(scheduled.job.model)
    optimizer = torch.optim.AdamW(param_groups(model, scheduled.group_lrs))
    batches = make_batches(scheduled.job.model, steps=scheduled.steps)
    lrs, moms, losses = [], [], []
    for step in range(scheduled.steps):
        for index, group in enumerate(optimizer.param_groups):
            lr, momentum = documented(step, index)
            group["lr"], group["betas"] = lr, (momentum, BETA2)
        lrs.append([group["lr"] for group in optimizer.param_groups])
        moms.append([group["betas"][0] for group in optimizer.param_groups])
        x, y = batches.micro(step, 0, 0)
        loss = mse(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = {k: v.detach().cpu().numpy().copy() for k, v in model.named_parameters()}
    return ScheduledRun(lrs, params, losses), moms


def is_this_bug(error: BaseException) -> bool:
    return isinstance(error, TypeError) and ERROR in str(error)


def hits(scheduled) -> bool:
    """True if the first ``engine.step()`` of ``scheduled`` raises this bug's TypeError, False if the loop runs
    and every group's LR is a number at every step; CannotTellError for anything else."""
    from ...exceptions import CannotTellError

    try:
        lrs, moms, _ = train_deepspeed(scheduled)
    except TypeError as error:
        if is_this_bug(error):
            return True
        raise CannotTellError(f"a TypeError other than this bug's: {error}") from error
    if not all(isinstance(value, float) for step in lrs + moms for value in step):
        raise CannotTellError(f"the loop ran but a group holds a non-number LR or momentum: {lrs} {moms}")
    return False


def reproduce() -> bool:
    """The user's job through ``deepspeed.initialize`` (OneCycle from the config with a list of one value per
    group for each bound, AdamW over two groups), one whole cycle: True if the first step raises the optimizer's
    TypeError on a list LR; False if every group follows its own documented schedule; CannotTellError if it
    follows neither."""
    from ...exceptions import CannotTellError

    scheduled = job()
    if hits(scheduled):
        return True
    lrs, moms, _ = train_deepspeed(scheduled)
    for step in range(scheduled.steps):
        for group in range(2):
            lr, mom = documented(step, group)
            if not (math.isclose(lrs[step][group], lr, rel_tol=1e-9) and math.isclose(moms[step][group], mom, rel_tol=1e-9)):
                raise CannotTellError(f"the loop ran but group {group} at step {step} has lr {lrs[step][group]}, "
                                      f"beta1 {moms[step][group]}, not its own schedule's {lr}, {mom}")
    return False


WARMUP_LR = {"type": "WarmupLR", "params": {"warmup_min_lr": MIN_LRS, "warmup_max_lr": MAX_LRS,
                                            "warmup_num_steps": FIRST_STEPS}}


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (OneCycle from the config with per-group
    lists, AdamW over two groups), the same under ZeRO-2 (the scheduler writes into the same torch optimizer's
    groups), then WarmupLR with the same per-group lists instead of OneCycle (it splits them per group on every
    release). Each cell asks: does the first ``engine.step()`` raise the TypeError of a list LR? A OneCycle cell
    with scalar bounds is not in the grid: the trigger reads the scheduler's type only (the lists are in its
    note), and with scalars there is nothing for the bug to split."""
    from dataclasses import replace

    from ...harness import Cell, trigger_job

    base = job(steps=2)

    def cell(label: str, scheduled, flips: str = "") -> Cell:
        return Cell(label, trigger_job(scheduled.config), lambda: hits(scheduled), flips)

    return [cell("OneCycle with per-group lists for cycle_min/max_lr and cycle_min/max_mom", base),
            cell("the same under ZeRO-2", replace(base, zero_stage=2)),
            cell("WarmupLR with per-group lists instead", replace(base, scheduler=WARMUP_LR), "scheduler")]
