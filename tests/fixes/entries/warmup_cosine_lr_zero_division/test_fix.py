"""warmup-cosine-lr-zero-division on its affected release, with warmup-cosine-lr-param-groups where both are
needed, and on the newest (fixed) one, in child processes."""
from tests.helpers import call_in_release

AFFECTED = "0.19.0"
BOTH_AFFECTED = "0.18.9"  # warmup-cosine-lr-param-groups is fixed from 0.19.0 on
FIX_ID = "warmup-cosine-lr-zero-division"
PARAM_GROUPS = "warmup-cosine-lr-param-groups"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.warmup_cosine_lr_zero_division import _TARGET

    return _TARGET.owner_and_name()[0]


def _scheduler(owner, total, warmup, groups=1):
    import torch

    layers = [torch.nn.Linear(2, 2) for _ in range(groups)]
    optimizer = torch.optim.AdamW([{"params": layer.parameters(), "lr": 1e-2 * (i + 1)}
                                   for i, layer in enumerate(layers)])
    return owner(optimizer, total_num_steps=total, warmup_num_steps=warmup, cos_min_ratio=0.1), optimizer


def get_lr_ratio(self):
    """A drifted WarmupCosineLR.get_lr_ratio that still divides by total - warmup unguarded."""
    if self.last_batch_iteration < self.warmup_num_steps:
        return self.last_batch_iteration / self.warmup_num_steps
    real_total_steps = self.total_num_steps - self.warmup_num_steps
    return 0.5 * (1 + (self.last_batch_iteration - self.warmup_num_steps + 1) / real_total_steps)


def check_guarded_after_warmup_and_unchanged_inside_the_window():
    import pytest

    import fixes

    owner = _owner()
    broken, _ = _scheduler(owner, 10, 10)
    with pytest.raises(ZeroDivisionError):
        broken.step(10)  # the first iteration after the warm-up
    below, _ = _scheduler(owner, 8, 10)  # total below warm-up: no error, the ratio jumps after the warm-up
    unfixed_below = [below.step(i) or below.get_lr_ratio() for i in range(10, 14)]
    assert len({round(r, 6) for r in unfixed_below}) > 1, unfixed_below
    normal, _ = _scheduler(owner, 10, 4)
    unfixed_normal = [normal.step(i) or normal.get_lr_ratio() for i in range(-1, 9)]  # the decay window
    fixes.apply(FIX_ID)
    for total in (10, 8):
        fixed, _ = _scheduler(owner, total, 10)
        for step in range(10, 15):  # upstream's test: every step past the warm-up at cos_min_ratio
            fixed.step(step)
            assert fixed.get_lr_ratio() == pytest.approx(0.1)
    normal, _ = _scheduler(owner, 10, 4)
    assert [normal.step(i) or normal.get_lr_ratio() for i in range(-1, 9)] == unfixed_normal
    fixes.revert(FIX_ID)


def check_composes_with_param_groups_fix_in_either_order():
    import pytest

    import fixes

    owner = _owner()
    originals = {name: vars(owner)[name] for name in ("get_lr", "get_lr_ratio")}
    assert fixes.get(FIX_ID).probe().affected and fixes.get(PARAM_GROUPS).probe().affected
    for order in ((FIX_ID, PARAM_GROUPS), (PARAM_GROUPS, FIX_ID)):
        outcomes = fixes.apply(*order)
        assert [o.action for o in outcomes] == ["applied", "applied"], outcomes
        scheduler, optimizer = _scheduler(owner, 4, 4, groups=2)
        assert [group["lr"] for group in optimizer.param_groups] == [0.0, 0.0]  # param-groups' fix
        for _ in range(6):  # through the warm-up and past it: no ZeroDivisionError
            scheduler.step()
        assert scheduler.get_last_lr() == pytest.approx([1e-3, 2e-3])  # cos_min_ratio 0.1 of each base LR
        fixes.revert()  # every applied fix, the last applied first
        assert {name: vars(owner)[name] for name in originals} == originals
        assert all(vars(owner)[name] is fn for name, fn in originals.items())
        assert not fixes.get(FIX_ID).applied and not fixes.get(PARAM_GROUPS).applied


def test_when_applied_then_past_warmup_is_cos_min_and_the_decay_window_unchanged():
    call_in_release(AFFECTED, check_guarded_after_warmup_and_unchanged_inside_the_window)


def test_when_both_warmup_cosine_fixes_applied_in_either_order_then_they_compose_and_revert_exactly():
    call_in_release(BOTH_AFFECTED, check_composes_with_param_groups_fix_in_either_order)
