"""onecycle-stair-counts-ignored on its reproduce release (0.19.3): zero stairs and one stair per batch keep the
continuous schedule, uneven halves, a scheduler built before the fix, and the momentum's stairs."""
import pytest
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

FIX_ID = "onecycle-stair-counts-ignored"


def _onecycle(stairs, first=8, second=8, second_stairs=None, optimizer=None, **momentum):
    from deepspeed.runtime.lr_schedules import OneCycle

    optimizer = optimizer or torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.99))
    return OneCycle(optimizer, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=first,
                    cycle_second_step_size=second, cycle_first_stair_count=stairs,
                    cycle_second_stair_count=second_stairs, **momentum)


def _lrs(stairs, steps=16, scheduler=None, **halves):
    """The LR after each ``step()`` of a OneCycle over one parameter (upstream's test of PR #8179 does the same)."""
    scheduler = scheduler or _onecycle(stairs, **halves)
    return [scheduler.step() or scheduler.get_lr()[0] for _ in range(steps)]


def check_the_fixed_schedule_is_the_documented_staircase():
    harness.setup()
    uneven = dict(first=10, second=21, second_stairs=21)  # 10 and 21 stairs over 10 and 21 batches: continuous
    continuous, asymmetric = _lrs(0), _lrs(10, steps=31, **uneven)
    built_before = _onecycle(10, **uneven)  # lacks the half lengths the fix records
    fixes.apply(FIX_ID)
    try:
        assert _lrs(0) == continuous, "a stair count of 0 must keep the continuous schedule bit for bit"
        assert _lrs(2) == pytest.approx([1e-3] * 3 + [5.5e-3] * 4 + [1e-2] + [5.5e-3] * 4 + [1e-3] * 4)
        assert _lrs(8) == continuous  # one stair per batch: the continuous schedule
        assert _lrs(10, steps=31, **uneven) == pytest.approx(asymmetric)
        recovered = _lrs(0, steps=31, scheduler=built_before)  # the half lengths recovered, not recorded
        assert recovered == pytest.approx(asymmetric) and recovered[9] == pytest.approx(1e-2)  # the peak kept
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        scheduler = _onecycle(2, first=4, second=None, optimizer=optimizer, cycle_min_mom=0.85, cycle_max_mom=0.99)
        moms = [scheduler.step() or optimizer.param_groups[0]["betas"][0] for _ in range(8)]
        assert moms == pytest.approx([0.99, 0.92, 0.92, 0.85, 0.92, 0.92, 0.99, 0.99])  # flat within a stair
    finally:
        fixes.revert(FIX_ID)


def test_when_applied_then_lr_and_momentum_follow_the_staircase_and_zero_stairs_stay_continuous():
    call_in_release("0.19.3", check_the_fixed_schedule_is_the_documented_staircase)
