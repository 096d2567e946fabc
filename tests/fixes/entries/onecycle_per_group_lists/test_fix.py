"""onecycle-per-group-lists on its reproduce release, on the oldest swept release and on the newest (fixed) one, in
child processes; and with onecycle-stair-counts-ignored, which patches other methods of the same class."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.19.3"
FIX_ID = "onecycle-per-group-lists"
STAIRS_ID = "onecycle-stair-counts-ignored"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.onecycle_per_group_lists import _INIT_LR

    return _INIT_LR.owner_and_name()[0]


def _scheduler(steps=0, optimizer=None, **params):
    """A OneCycle over two parameter groups (upstream's test of PR #8201 does the same), stepped ``steps`` times;
    returns it and its optimizer."""
    import torch

    from deepspeed.runtime.lr_schedules import OneCycle

    if optimizer is None:
        optimizer = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                      {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
    settings = dict(cycle_min_lr=[1e-3, 2e-3], cycle_max_lr=[1e-2, 4e-2], cycle_first_step_size=4,
                    cycle_min_mom=[0.85, 0.8], cycle_max_mom=[0.99, 0.95])
    settings.update(params)
    scheduler = OneCycle(optimizer, **settings)
    for _ in range(steps):
        scheduler.step()
    return scheduler, optimizer


def _state(optimizer):
    return [(group["lr"], tuple(group["betas"])) for group in optimizer.param_groups]


def check_each_group_gets_its_own_bounds_and_scalars_are_unchanged():
    import pytest
    import torch

    import fixes
    from fixes.entries.onecycle_per_group_lists import reproduce as onecycle

    _owner()
    _, optimizer = _scheduler()
    assert optimizer.param_groups[0]["lr"] == [1e-3, 2e-3], "the list is already split on this release"
    scalar_runs = {steps: _state(_scheduler(steps, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_min_mom=0.85,
                                            cycle_max_mom=0.99)[1]) for steps in (0, 4, 8)}
    fixes.apply(FIX_ID)
    try:
        _, optimizer = _scheduler()  # construction: each group's own cycle_min_lr and cycle_min_mom
        assert _state(optimizer) == [(1e-3, (0.85, 0.99)), (2e-3, (0.8, 0.99))]
        _, optimizer = _scheduler(4)  # the peak: each group's own cycle_max_lr, momentum at its cycle_min_mom
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-2, 4e-2])
        assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.85, 0.8])
        _, optimizer = _scheduler(8)  # the bottom: back to cycle_min_lr, momentum at its own cycle_max_mom
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-3, 2e-3])
        assert [g["betas"][0] for g in optimizer.param_groups] == pytest.approx([0.99, 0.95])
        # a scalar for one bound and a list for the other: the scalar is broadcast
        _, optimizer = _scheduler(4, cycle_min_lr=1e-3)
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([1e-2, 4e-2])
        # scalar bounds: the installed code, bit for bit
        for steps, state in scalar_runs.items():
            assert _state(_scheduler(steps, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_min_mom=0.85,
                                     cycle_max_mom=0.99)[1]) == state
        # a list of the wrong length is refused before the optimizer is touched
        for name in ("cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"):
            optimizer = torch.optim.Adam([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.1},
                                          {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2}])
            with pytest.raises(ValueError, match=f"expected 2 value for {name}, got 3"):
                _scheduler(optimizer=optimizer, **{name: [0.5, 0.6, 0.7]})
            if name.endswith("_lr"):
                assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.2]
        # an optimizer without betas: momentum cycling is turned off, as the installed code does
        sgd = torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))]},
                               {"params": [torch.nn.Parameter(torch.zeros(1))]}], lr=0.1)
        scheduler, _ = _scheduler(2, optimizer=sgd)
        assert scheduler.cycle_momentum is False
        assert [g["lr"] for g in sgd.param_groups] == pytest.approx([5.5e-3, 2.1e-2])
        assert onecycle.reproduce() is False  # the notebook's job through deepspeed.initialize
    finally:
        fixes.revert(FIX_ID)
    _, optimizer = _scheduler()
    assert optimizer.param_groups[0]["lr"] == [1e-3, 2e-3]


def _per_group_staircase():
    """LRs over one cycle with per-group lists and 2 stairs per half: both fixes are needed for it."""
    lrs = []
    scheduler, optimizer = _scheduler(cycle_first_stair_count=2, cycle_second_stair_count=2)
    for _ in range(8):
        scheduler.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])
    return lrs


def check_composes_with_the_stair_count_fix_in_either_order():
    import pytest

    import fixes
    from deepspeed.runtime.lr_schedules import OneCycle

    _owner()
    before = dict(vars(OneCycle))
    low, mid, high = (1e-3, 2e-3), (5.5e-3, 2.1e-2), (1e-2, 4e-2)
    expected = pytest.approx([lr for step in (low, mid, mid, high, mid, mid, low, low) for lr in step])
    for order in ((FIX_ID, STAIRS_ID), (STAIRS_ID, FIX_ID)):
        for fix_id in order:
            fixes.apply(fix_id)
        try:
            assert [lr for step in _per_group_staircase() for lr in step] == expected, order
        finally:
            fixes.revert()  # all of them, in reverse order of applying
        assert all(vars(OneCycle)[name] is value for name, value in before.items()), order
    # either one reverts alone: they patch different methods
    fixes.apply(STAIRS_ID)
    fixes.apply(FIX_ID)
    fixes.revert(STAIRS_ID)
    assert _scheduler()[1].param_groups[1]["lr"] == 2e-3
    fixes.revert(FIX_ID)
    assert all(vars(OneCycle)[name] is value for name, value in before.items())


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.onecycle_per_group_lists import _INIT_LR

    owner, name = _INIT_LR.owner_and_name()

    def _initialize_lr(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate, last_batch_iteration):
        """A drifted _initialize_lr that still repeats the value into every group."""
        self.min_lrs = [cycle_min_lr] * len(optimizer.param_groups)
        self.max_lrs = [cycle_max_lr] * len(optimizer.param_groups)
        self.decay_lr_rate = decay_lr_rate

    _owner()
    assert_drift_refused(FIX_ID, owner, name, _initialize_lr)


def test_when_applied_then_each_group_cycles_between_its_own_bounds_and_scalars_are_unchanged():
    call_in_release(AFFECTED, check_each_group_gets_its_own_bounds_and_scalars_are_unchanged)


def test_when_applied_with_the_stair_count_fix_then_they_compose_in_either_order():
    call_in_release(AFFECTED, check_composes_with_the_stair_count_fix_in_either_order)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
