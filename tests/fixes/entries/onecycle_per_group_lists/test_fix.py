"""onecycle-per-group-lists on its reproduce release (0.19.3): bounds mixing scalars and lists, scalars left bit for
bit, lists of the wrong length, an optimizer without betas, and with onecycle-stair-counts-ignored in either order."""
import pytest
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
FIX_ID = "onecycle-per-group-lists"
STAIRS_ID = "onecycle-stair-counts-ignored"
SCALARS = dict(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_min_mom=0.85, cycle_max_mom=0.99)


def _scheduler(steps=0, optimizer=None, **params):
    """A OneCycle over two parameter groups (as upstream's test of PR #8201), stepped ``steps`` times; and its
    optimizer, whose (lr, betas) per group the second item lists."""
    from deepspeed.runtime.lr_schedules import OneCycle

    optimizer = optimizer or torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                               {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    scheduler = OneCycle(optimizer, **{**dict(cycle_min_lr=[1e-3, 2e-3], cycle_max_lr=[1e-2, 4e-2],
                                              cycle_first_step_size=4, cycle_min_mom=[0.85, 0.8],
                                              cycle_max_mom=[0.99, 0.95]), **params})
    for _ in range(steps):
        scheduler.step()
    return scheduler, [(group["lr"], tuple(group.get("betas", ()))) for group in optimizer.param_groups]


def _group_lrs(scheduler):
    return [group["lr"] for group in scheduler.optimizer.param_groups]


def check_each_group_gets_its_own_bounds_and_scalars_are_unchanged():
    harness.setup()
    scalar_runs = {steps: _scheduler(steps, **SCALARS)[1] for steps in (0, 4, 8)}
    fixes.apply(FIX_ID)
    try:
        assert _scheduler()[1] == [(1e-3, (0.85, 0.99)), (2e-3, (0.8, 0.99))]  # each group's own minimum
        # the peak, each group's own cycle_max_lr, momentum at its cycle_min_mom; the bottom; a scalar with a list
        for steps, params, lrs, moms in ((4, {}, [1e-2, 4e-2], [0.85, 0.8]), (8, {}, [1e-3, 2e-3], [0.99, 0.95]),
                                         (4, {"cycle_min_lr": 1e-3}, [1e-2, 4e-2], [0.85, 0.8])):
            state = _scheduler(steps, **params)[1]
            assert [lr for lr, _ in state] == pytest.approx(lrs) and [b[0] for _, b in state] == pytest.approx(moms)
        assert {steps: _scheduler(steps, **SCALARS)[1] for steps in (0, 4, 8)} == scalar_runs  # bit for bit
        for name in SCALARS:  # a list of the wrong length is refused before the optimizer is touched
            optimizer = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                          {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
            with pytest.raises(ValueError, match=f"expected 2 value for {name}, got 3"):
                _scheduler(optimizer=optimizer, **{name: [0.5, 0.6, 0.7]})
            assert name.endswith("_mom") or [g["lr"] for g in optimizer.param_groups] == [0.1, 0.2]
        sgd = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                               {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)
        scheduler, state = _scheduler(2, optimizer=sgd)  # no betas: momentum cycling off, as the installed code does
        assert scheduler.cycle_momentum is False and [lr for lr, _ in state] == pytest.approx([5.5e-3, 2.1e-2])
    finally:
        fixes.revert(FIX_ID)


def check_composes_with_the_stair_count_fix_in_either_order():
    harness.setup()
    from deepspeed.runtime.lr_schedules import OneCycle

    before = dict(vars(OneCycle))
    low, mid, high = (1e-3, 2e-3), (5.5e-3, 2.1e-2), (1e-2, 4e-2)
    expected = pytest.approx([lr for step in (low, mid, mid, high, mid, mid, low, low) for lr in step])
    for order in ((FIX_ID, STAIRS_ID), (STAIRS_ID, FIX_ID)):
        for fix_id in order:
            fixes.apply(fix_id)
        try:  # per-group lists and 2 stairs per half: both fixes are needed for it
            scheduler, _ = _scheduler(cycle_first_stair_count=2, cycle_second_stair_count=2)
            lrs = [lr for _ in range(8) for lr in (scheduler.step() or _group_lrs(scheduler))]
            assert lrs == expected, order
        finally:
            fixes.revert()  # all of them, in reverse order of applying
        assert all(vars(OneCycle)[name] is value for name, value in before.items()), order
    fixes.apply(STAIRS_ID)  # either one reverts alone: they patch different methods
    fixes.apply(FIX_ID)
    fixes.revert(STAIRS_ID)
    assert _scheduler()[1][1][0] == 2e-3
    fixes.revert(FIX_ID)
    assert all(vars(OneCycle)[name] is value for name, value in before.items())


def test_when_applied_then_each_group_cycles_between_its_own_bounds_and_scalars_are_unchanged():
    call_in_release(AFFECTED, check_each_group_gets_its_own_bounds_and_scalars_are_unchanged)


def test_when_applied_with_the_stair_count_fix_then_they_compose_in_either_order():
    call_in_release(AFFECTED, check_composes_with_the_stair_count_fix_in_either_order)
