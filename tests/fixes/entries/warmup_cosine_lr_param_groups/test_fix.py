"""warmup-cosine-lr-param-groups on its affected release and on the newest (fixed) one, in child processes."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
FIX_ID = "warmup-cosine-lr-param-groups"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.warmup_cosine_lr_param_groups import _TARGET

    return _TARGET.owner_and_name()[0]


def _scheduler(owner, groups=3):
    import torch

    layers = [torch.nn.Linear(2, 2) for _ in range(groups)]
    optimizer = torch.optim.AdamW([{"params": layer.parameters(), "lr": 1e-2 * (i + 1)}
                                   for i, layer in enumerate(layers)])
    return owner(optimizer, total_num_steps=10, warmup_num_steps=4), optimizer


def check_every_group_starts_at_zero_and_later_steps_are_the_originals():
    import fixes

    owner = _owner()
    unfixed, unfixed_optimizer = _scheduler(owner)
    assert [group["lr"] for group in unfixed_optimizer.param_groups] == [0.0, 2e-2, 3e-2]  # the bug
    fixes.apply(FIX_ID)
    fixed, fixed_optimizer = _scheduler(owner)
    assert [group["lr"] for group in fixed_optimizer.param_groups] == [0.0, 0.0, 0.0]
    for _ in range(12):  # warm-up, decay and past total_num_steps: the original's LRs, unchanged
        unfixed.step()
        fixed.step()
        assert fixed.get_last_lr() == unfixed.get_last_lr()
    fixes.revert(FIX_ID)


def test_when_applied_then_every_group_starts_at_zero_and_later_lrs_are_unchanged():
    call_in_release(AFFECTED, check_every_group_starts_at_zero_and_later_steps_are_the_originals)
