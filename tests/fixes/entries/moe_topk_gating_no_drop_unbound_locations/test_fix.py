"""moe-topk-gating-no-drop-unbound-locations on its affected releases, with the other topkgating fixes where all are
needed, and on the first fixed and the newest release, in child processes."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.17.0"
FIRST_FIXED = "0.17.1"  # upstream PR #7163's topkgating: the no-drop path the fix runs, line for line
FIX_ID = "moe-topk-gating-no-drop-unbound-locations"
BY_LOGITS = "moe-topk-gating-capacity-by-logits"  # same function, drop_tokens=True path; affected through 0.18.9
EXCEEDS = "moe-capacity-exceeds-tokens"  # same function, drop_tokens=True path; requires BY_LOGITS


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import _TARGET

    return _TARGET.owner_and_name()[0]


def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
    """A drifted topkgating whose no-drop branch still sets no locations (and has no capacity cut at all)."""
    import torch

    mask = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, torch.topk(logits, k=k, dim=1)[1], 1)
    if drop_tokens:
        locations = torch.cumsum(mask, dim=0) - 1
    else:
        capacity = int(mask.sum(dim=0).max())
    return locations * mask, capacity


def _outputs_digest(outputs: dict) -> str:
    """A hash of the gate's outputs, bit for bit (dtype, shape and bytes of each)."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(outputs):
        tensor = outputs[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.reshape(-1).float().numpy().tobytes() if tensor.dtype.is_floating_point
                      else tensor.reshape(-1).long().numpy().tobytes())
    return digest.hexdigest()


def _print_no_drop_digests():
    """One line per dtype: the digest of ``topkgating(..., drop_tokens=False)`` on the reproduction's logits."""
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce

    for dtype in ("float32", "bfloat16"):
        print(f"DIGEST {dtype} {_outputs_digest(reproduce.deepspeed_gating(reproduce.gating_logits(dtype)))}")


def _digests(stdout: str) -> dict[str, str]:
    return dict(line.split()[1:] for line in stdout.splitlines() if line.startswith("DIGEST "))


def check_the_gate_raises_until_fixed_then_equals_the_reference_in_each_dtype():
    import pytest
    import torch

    import fixes
    from fixes import harness
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce

    _owner()
    with pytest.raises(UnboundLocalError, match="locations"):
        reproduce.deepspeed_gating(reproduce.gating_logits("float32"))
    fixes.apply(FIX_ID)
    for dtype in ("float32", "bfloat16"):
        logits = reproduce.gating_logits(dtype)
        got, want = reproduce.deepspeed_gating(logits), reproduce.reference_topk_gating(logits, reproduce.K)
        assert all(reproduce.gating_vs_reference(got, want).values()), dtype
        assert harness.compare(got["combine_weights"], want["combine_weights"], dtype).close, dtype
        assert harness.compare(got["l_aux"], want["l_aux"], dtype).close, dtype
        assert got["combine_weights"].dtype == torch.float32
        assert int(got["dispatch_mask"].sum()) == reproduce.TOKENS * reproduce.K  # nothing dropped
    _print_no_drop_digests()
    fixes.revert(FIX_ID)


def check_the_first_fixed_release_gives_these_outputs():
    _owner()
    _print_no_drop_digests()


def check_the_fix_leaves_token_dropping_to_the_original():
    import torch

    import fixes
    from deepspeed.moe import sharded_moe
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce

    _owner()
    logits = reproduce.gating_logits("float32")
    calls = [(True, None, "probs"), (True, None, "position")]
    before = [sharded_moe.topkgating(logits, 3, 1.0, 4, *call) for call in calls]
    fixes.apply(FIX_ID)
    after = [sharded_moe.topkgating(logits, 3, 1.0, 4, *call) for call in calls]
    for old, new in zip(before, after):
        assert all(torch.equal(a, b) for a, b in zip(old, new))
    fixes.revert(FIX_ID)


def check_a_moe_layer_built_before_the_fix_trains_like_plain_pytorch_after_it():
    import copy

    import pytest
    import torch

    import fixes
    from fixes import harness
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce

    _owner()
    moe = reproduce.moe_layer()
    reference = copy.deepcopy(moe)
    with pytest.raises(UnboundLocalError, match="locations"):
        moe(reproduce.tokens())
    fixes.apply(FIX_ID)
    optimizer = torch.optim.SGD(moe.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(3):
        x = reproduce.tokens(1000 + step)
        output, l_aux, _ = moe(x)
        want, want_l_aux = reproduce.reference_moe(reference, x)
        assert harness.compare(output, want, "float32").close, step
        assert harness.compare(l_aux, want_l_aux, "float32").close, step
        for model, loss, opt in ((moe, output.square().mean() + 0.01 * l_aux, optimizer),
                                 (reference, want.square().mean() + 0.01 * want_l_aux, reference_optimizer)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert harness.compare(dict(moe.named_parameters()), dict(reference.named_parameters()), "float32").close
    fixes.revert(FIX_ID)


def check_composes_with_the_other_topkgating_fixes_in_either_order():
    import torch

    import fixes
    from deepspeed.moe import sharded_moe
    from fixes import harness
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import reproduce

    _owner()
    original = vars(sharded_moe)["topkgating"]
    assert all(fixes.get(i).probe().affected for i in (FIX_ID, BY_LOGITS, EXCEEDS))
    few = reproduce.gating_logits("float32", tokens=3)  # fewer tokens than the capacity: EXCEEDS's crash
    for order in ((FIX_ID, BY_LOGITS, EXCEEDS), (BY_LOGITS, EXCEEDS, FIX_ID), (EXCEEDS, FIX_ID), (), "each"):
        if order == "each":  # one call each, this entry last, then this entry's revert alone
            for fix_id in (BY_LOGITS, EXCEEDS, FIX_ID):
                fixes.apply(fix_id)
        else:
            outcomes = {o.fix_id: o.action for o in fixes.apply(*order)}  # (): every needed fix
            assert all(outcomes[i] in ("applied", "already applied") for i in order or (FIX_ID, BY_LOGITS, EXCEEDS)), outcomes
        assert all(fixes.get(i).applied for i in (FIX_ID, BY_LOGITS, EXCEEDS)), order
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
        assert not any(fixes.get(i).applied for i in (FIX_ID, BY_LOGITS, EXCEEDS)), order
    with torch.no_grad():
        assert reproduce.forward_error(lambda: reproduce.moe_layer()(reproduce.tokens())) is not None


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.moe_topk_gating_no_drop_unbound_locations import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, topkgating)


def test_when_drop_tokens_is_false_then_the_gate_raises_until_fixed_and_then_equals_the_reference():
    call_in_release(AFFECTED, check_the_gate_raises_until_fixed_then_equals_the_reference_in_each_dtype)


def test_when_applied_then_the_gate_outputs_are_bit_for_bit_the_first_fixed_release_s():
    fixed_here = _digests(call_in_release(AFFECTED, check_the_gate_raises_until_fixed_then_equals_the_reference_in_each_dtype))
    upstream = _digests(call_in_release(FIRST_FIXED, check_the_first_fixed_release_gives_these_outputs))
    assert fixed_here.keys() == {"float32", "bfloat16"} and fixed_here == upstream, (fixed_here, upstream)


def test_when_drop_tokens_is_true_then_the_fix_returns_what_the_original_returns():
    call_in_release(AFFECTED, check_the_fix_leaves_token_dropping_to_the_original)


def test_when_a_moe_layer_was_built_before_the_fix_then_it_trains_like_plain_pytorch_after_it():
    call_in_release(AFFECTED, check_a_moe_layer_built_before_the_fix_trains_like_plain_pytorch_after_it)


def test_when_all_three_topkgating_fixes_applied_in_any_order_then_they_compose_and_revert_exactly():
    call_in_release(AFFECTED, check_composes_with_the_other_topkgating_fixes_in_either_order)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
