"""warmup-cosine-lr-param-groups beyond the contract and the notebook (0.18.9, the schedule of every group vs its
documented values): past the first step, and past total_num_steps, the fix leaves the original's LRs."""
from tests.helpers import call_in_release


def check_every_group_starts_at_zero_and_later_steps_are_the_originals():
    import torch

    import fixes
    from fixes.entries.warmup_cosine_lr_param_groups import _TARGET
    from fixes.harness import setup

    setup()

    def scheduler():
        layers = [torch.nn.Linear(2, 2) for _ in range(3)]
        optimizer = torch.optim.AdamW([{"params": layer.parameters(), "lr": 1e-2 * (i + 1)}
                                       for i, layer in enumerate(layers)])
        return _TARGET.owner_and_name()[0](optimizer, total_num_steps=10, warmup_num_steps=4), optimizer

    unfixed, unfixed_optimizer = scheduler()
    assert [group["lr"] for group in unfixed_optimizer.param_groups] == [0.0, 2e-2, 3e-2]  # the bug
    fixes.apply("warmup-cosine-lr-param-groups")
    fixed, fixed_optimizer = scheduler()
    assert [group["lr"] for group in fixed_optimizer.param_groups] == [0.0, 0.0, 0.0]
    for _ in range(12):  # warm-up, decay and past total_num_steps: the original's LRs, unchanged
        unfixed.step()
        fixed.step()
        assert fixed.get_last_lr() == unfixed.get_last_lr()


def test_when_applied_then_every_group_starts_at_zero_and_later_lrs_are_unchanged():
    call_in_release("0.18.9", check_every_group_starts_at_zero_and_later_steps_are_the_originals)
