"""moe-topk-gating-capacity-by-logits on its reproduce release (0.18.9), in a child process: the drop paths the fix
leaves to the original."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
FIX_ID = "moe-topk-gating-capacity-by-logits"


def check_the_fix_leaves_the_other_drop_paths_to_the_original():
    import torch
    import fixes
    from deepspeed.moe import sharded_moe
    from fixes.entries.moe_topk_gating_capacity_by_logits import reproduce
    from fixes.harness import setup

    setup()
    logits = reproduce.gating_logits("float32", shift=-4.0)
    calls = [(True, None, "position"), (False, None, "probs")]
    before = [sharded_moe.topkgating(logits, 3, 1.0, 4, *call) for call in calls]
    fixes.apply(FIX_ID)
    after = [sharded_moe.topkgating(logits, 3, 1.0, 4, *call) for call in calls]
    assert all(torch.equal(a, b) for old, new in zip(before, after) for a, b in zip(old, new))


def test_when_drop_policy_is_position_or_nothing_is_dropped_then_the_fix_returns_what_the_original_returns():
    call_in_release(AFFECTED, check_the_fix_leaves_the_other_drop_paths_to_the_original)
