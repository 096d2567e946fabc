"""warmup-cosine-lr-zero-division: totals at and below the warm-up, the decay window left alone, and with
warmup-cosine-lr-param-groups on 0.18.9, where both are needed."""
import pytest
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

FIX_ID = "warmup-cosine-lr-zero-division"
PARAM_GROUPS = "warmup-cosine-lr-param-groups"


def _owner():
    harness.setup()
    from fixes.entries.warmup_cosine_lr_zero_division import _TARGET

    return _TARGET.owner_and_name()[0]


def _scheduler(owner, total, warmup, groups=1):
    layers = [torch.nn.Linear(2, 2) for _ in range(groups)]
    optimizer = torch.optim.AdamW([{"params": layer.parameters(), "lr": 1e-2 * (i + 1)}
                                   for i, layer in enumerate(layers)])
    return owner(optimizer, total_num_steps=total, warmup_num_steps=warmup, cos_min_ratio=0.1), optimizer


def check_guarded_after_warmup_and_unchanged_inside_the_window():
    owner = _owner()
    below, _ = _scheduler(owner, 8, 10)  # total below warm-up: no error, the ratio jumps after the warm-up
    assert len({round(below.step(i) or below.get_lr_ratio(), 6) for i in range(10, 14)}) > 1
    normal, _ = _scheduler(owner, 10, 4)
    unfixed_normal = [normal.step(i) or normal.get_lr_ratio() for i in range(-1, 9)]  # the decay window
    fixes.apply(FIX_ID)
    try:
        for total in (10, 8):
            fixed, _ = _scheduler(owner, total, 10)
            for step in range(10, 15):  # upstream's test: every step past the warm-up at cos_min_ratio
                fixed.step(step)
                assert fixed.get_lr_ratio() == pytest.approx(0.1)
        normal, _ = _scheduler(owner, 10, 4)
        assert [normal.step(i) or normal.get_lr_ratio() for i in range(-1, 9)] == unfixed_normal
    finally:
        fixes.revert(FIX_ID)


def check_composes_with_param_groups_fix_in_either_order():
    owner = _owner()
    originals = {name: vars(owner)[name] for name in ("get_lr", "get_lr_ratio")}
    assert fixes.get(FIX_ID).probe().affected and fixes.get(PARAM_GROUPS).probe().affected
    for order in ((FIX_ID, PARAM_GROUPS), (PARAM_GROUPS, FIX_ID)):
        assert [o.action for o in fixes.apply(*order)] == ["applied", "applied"], order
        scheduler, optimizer = _scheduler(owner, 4, 4, groups=2)
        assert [group["lr"] for group in optimizer.param_groups] == [0.0, 0.0]  # param-groups' fix
        for _ in range(6):  # through the warm-up and past it: no ZeroDivisionError
            scheduler.step()
        assert scheduler.get_last_lr() == pytest.approx([1e-3, 2e-3])  # cos_min_ratio 0.1 of each base LR
        fixes.revert()  # every applied fix, the last applied first
        assert all(vars(owner)[name] is fn for name, fn in originals.items())
        assert not fixes.get(FIX_ID).applied and not fixes.get(PARAM_GROUPS).applied


def test_when_applied_then_past_warmup_is_cos_min_and_the_decay_window_unchanged():
    call_in_release("0.19.0", check_guarded_after_warmup_and_unchanged_inside_the_window)


def test_when_both_warmup_cosine_fixes_applied_in_either_order_then_they_compose_and_revert_exactly():
    call_in_release("0.18.9", check_composes_with_param_groups_fix_in_either_order)
