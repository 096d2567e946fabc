"""moe-topk-gating-no-drop-unbound-locations on its last affected release (0.17.0), in child processes: the fixed gate
bit for bit upstream's (0.17.1), token dropping left alone, and composing with the other two topkgating fixes."""
from tests.helpers import call_in_release

AFFECTED = "0.17.0"
FIRST_FIXED = "0.17.1"  # upstream PR #7163's topkgating: the no-drop path the fix runs, line for line
FIX_ID = "moe-topk-gating-no-drop-unbound-locations"
BY_LOGITS = "moe-topk-gating-capacity-by-logits"  # same function, drop_tokens=True path; affected through 0.18.9
EXCEEDS = "moe-capacity-exceeds-tokens"  # same function, drop_tokens=True path; requires BY_LOGITS


def check_print_no_drop_digests(apply: bool):
    """Per dtype, a line with a hash of ``topkgating(..., drop_tokens=False)``'s outputs, bit for bit."""
    import hashlib

    import fixes
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce
    from fixes.harness import setup

    setup()
    if apply:
        fixes.apply(FIX_ID)
    for dtype in ("float32", "bfloat16"):
        digest, outputs = hashlib.sha256(), reproduce.deepspeed_gating(reproduce.gating_logits(dtype))
        for name in sorted(outputs):
            tensor = outputs[name].detach().cpu().contiguous()
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            digest.update((tensor.float() if tensor.dtype.is_floating_point else tensor.long()).numpy().tobytes())
        print(f"DIGEST {dtype} {digest.hexdigest()}")


def check_the_fix_leaves_token_dropping_to_the_original():
    import torch

    import fixes
    from deepspeed.moe import sharded_moe
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce
    from fixes.harness import setup

    setup()
    logits, calls = reproduce.gating_logits("float32"), [(True, None, "probs"), (True, None, "position")]
    before = [sharded_moe.topkgating(logits, 3, 1.0, 4, *call) for call in calls]
    fixes.apply(FIX_ID)
    after = [sharded_moe.topkgating(logits, 3, 1.0, 4, *call) for call in calls]
    assert all(torch.equal(a, b) for old, new in zip(before, after) for a, b in zip(old, new))


def check_composes_with_the_other_topkgating_fixes_in_either_order():
    import torch

    import fixes
    from deepspeed.moe import sharded_moe
    from fixes import harness
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce
    from fixes.harness import setup

    setup()
    original, all_three = vars(sharded_moe)["topkgating"], (FIX_ID, BY_LOGITS, EXCEEDS)
    assert all(fixes.get(i).probe().affected for i in all_three)
    few = reproduce.gating_logits("float32", tokens=3)  # fewer tokens than the capacity: EXCEEDS's crash
    for order in ((FIX_ID, BY_LOGITS, EXCEEDS), (BY_LOGITS, EXCEEDS, FIX_ID), (EXCEEDS, FIX_ID), (), "each"):
        if order == "each":  # one call each, this entry last, then this entry's revert alone
            for fix_id in (BY_LOGITS, EXCEEDS, FIX_ID):
                fixes.apply(fix_id)
        else:
            outcomes = {o.fix_id: o.action for o in fixes.apply(*order)}  # (): every needed fix
            assert all(outcomes[i] in ("applied", "already applied") for i in order or all_three), outcomes
        assert all(fixes.get(i).applied for i in all_three), order
        logits = reproduce.gating_logits("float32")
        got, want = reproduce.deepspeed_gating(logits), reproduce.reference_topk_gating(logits, reproduce.K)
        assert all(reproduce.gating_vs_reference(got, want).values()), order
        assert harness.compare(got["combine_weights"], want["combine_weights"], "float32").close, order
        assert int(sharded_moe.topkgating(few, 3, 1.0, 4, True, None)[2].sum()) == 9, order  # EXCEEDS: no crash
        dropped = sharded_moe.topkgating(logits - 4.0, 3, 1.0, 4, True, None)[2]  # BY_LOGITS: routes by probability
        assert int(dropped.sum()) > 0, order
        if order == "each":
            assert [o.action for o in fixes.revert(FIX_ID)] == ["reverted"]  # the last applied comes off alone
            assert not fixes.get(FIX_ID).applied and fixes.get(BY_LOGITS).applied
        fixes.revert()  # every applied fix, the last applied first
        assert vars(sharded_moe)["topkgating"] is original, order
        assert not any(fixes.get(i).applied for i in all_three), order
    with torch.no_grad():
        assert reproduce.forward_error(lambda: reproduce.moe_layer()(reproduce.tokens())) is not None


def _digests(stdout: str) -> dict[str, str]:
    return dict(line.split()[1:] for line in stdout.splitlines() if line.startswith("DIGEST "))


def test_when_applied_then_the_gate_outputs_are_bit_for_bit_the_first_fixed_release_s():
    fixed_here = _digests(call_in_release(AFFECTED, check_print_no_drop_digests, args=(True,)))
    upstream = _digests(call_in_release(FIRST_FIXED, check_print_no_drop_digests, args=(False,)))
    assert fixed_here.keys() == {"float32", "bfloat16"} and fixed_here == upstream, (fixed_here, upstream)


def test_when_drop_tokens_is_true_then_the_fix_returns_what_the_original_returns():
    call_in_release(AFFECTED, check_the_fix_leaves_token_dropping_to_the_original)


def test_when_all_three_topkgating_fixes_applied_in_any_order_then_they_compose_and_revert_exactly():
    call_in_release(AFFECTED, check_composes_with_the_other_topkgating_fixes_in_either_order)
