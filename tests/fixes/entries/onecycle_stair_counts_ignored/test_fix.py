"""onecycle-stair-counts-ignored on its reproduce release, on the oldest swept release and on the newest (fixed)
one, in child processes."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.3"
FIX_ID = "onecycle-stair-counts-ignored"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.onecycle_stair_counts_ignored import _SCALE

    return _SCALE.owner_and_name()[0]


def _lrs(stairs, steps=16, first=8, second=8, second_stairs=None, scheduler=None):
    """The LR after each ``step()`` of a OneCycle over one parameter (upstream's test of PR #8179 does the same)."""
    import torch

    from deepspeed.runtime.lr_schedules import OneCycle

    if scheduler is None:
        optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, betas=(0.9, 0.99))
        scheduler = OneCycle(optimizer, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=first,
                             cycle_second_step_size=second, cycle_first_stair_count=stairs,
                             cycle_second_stair_count=second_stairs)
    lrs = []
    for _ in range(steps):
        scheduler.step()
        lrs.append(scheduler.get_lr()[0])
    return lrs


def _moms(stairs):
    import torch

    from deepspeed.runtime.lr_schedules import OneCycle

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = OneCycle(optimizer, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=4,
                         cycle_first_stair_count=stairs, cycle_min_mom=0.85, cycle_max_mom=0.99)
    moms = []
    for _ in range(8):
        scheduler.step()
        moms.append(optimizer.param_groups[0]["betas"][0])
    return moms


def check_the_fixed_schedule_is_the_documented_staircase():
    import pytest

    import fixes
    from fixes.entries.onecycle_stair_counts_ignored import reproduce as onecycle

    _owner()
    continuous = _lrs(0)
    assert _lrs(2) == continuous, "the stair count already changes the schedule on this release"
    # a scheduler built before the fix is applied (it lacks the half lengths the fix records): 10 and 21
    # stairs over halves of 10 and 21 batches, one stair per batch, must be the continuous schedule again
    asymmetric = _lrs(10, steps=31, first=10, second=21, second_stairs=21)
    import torch
    from deepspeed.runtime.lr_schedules import OneCycle

    built_before = OneCycle(torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=1e-3), cycle_min_lr=1e-3,
                            cycle_max_lr=1e-2, cycle_first_step_size=10, cycle_second_step_size=21,
                            cycle_first_stair_count=10, cycle_second_stair_count=21)
    fixes.apply(FIX_ID)
    try:
        assert _lrs(0) == continuous, "a stair count of 0 must keep the continuous schedule bit for bit"
        stairs = _lrs(2)
        assert stairs[:8] == pytest.approx([1e-3, 1e-3, 1e-3, 5.5e-3, 5.5e-3, 5.5e-3, 5.5e-3, 1e-2])
        assert stairs[8:] == pytest.approx([5.5e-3, 5.5e-3, 5.5e-3, 5.5e-3, 1e-3, 1e-3, 1e-3, 1e-3])
        assert _lrs(8) == continuous  # one stair per batch: the continuous schedule
        assert _lrs(10, steps=31, first=10, second=21, second_stairs=21) == pytest.approx(asymmetric)
        recovered = _lrs(0, steps=31, scheduler=built_before)  # the half lengths recovered, not recorded
        assert recovered == pytest.approx(asymmetric) and recovered[9] == pytest.approx(1e-2)  # the peak kept
        # the momentum stairs with the LR: flat within a stair, then a jump
        assert _moms(2) == pytest.approx([0.99, 0.92, 0.92, 0.85, 0.92, 0.92, 0.99, 0.99])
        # the notebook's job through deepspeed.initialize: its LRs are the documented staircase
        assert onecycle.reproduce() is False
    finally:
        fixes.revert(FIX_ID)
    assert _lrs(2) == continuous


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.onecycle_stair_counts_ignored import _SCALE

    owner, name = _SCALE.owner_and_name()

    def _get_scale_factor(self):
        """A drifted _get_scale_factor that still ignores the stair counts."""
        batch_iteration = self.last_batch_iteration + 1
        x = batch_iteration / self.total_size % 1.0
        return x / self.step_ratio if x <= self.step_ratio else (x - 1) / (self.step_ratio - 1)

    _owner()
    assert_drift_refused(FIX_ID, owner, name, _get_scale_factor)


def check_fixed_release_is_a_noop():
    from fixes.entries.onecycle_stair_counts_ignored.reproduce import reproduce

    assert_noop_on_fixed_release(FIX_ID, _owner())
    assert reproduce() is False
    assert _lrs(2) != _lrs(0)


def test_when_applied_then_lr_and_momentum_follow_the_staircase_and_zero_stairs_stay_continuous():
    call_in_release(AFFECTED, check_the_fixed_schedule_is_the_documented_staircase)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
