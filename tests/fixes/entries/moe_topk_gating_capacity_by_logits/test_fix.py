"""moe-topk-gating-capacity-by-logits on its affected releases and on the newest (fixed) one, in child processes."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.18.9"
FIX_ID = "moe-topk-gating-capacity-by-logits"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.moe_topk_gating_capacity_by_logits import _TARGET

    return _TARGET.owner_and_name()[0]


def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
    """A drifted topkgating that still ranks the capacity cut by logits (and drops the renormalisation)."""
    import torch

    top_gate, top_idx = torch.topk(logits, k=k, dim=1)
    topk_masked_gates = torch.zeros_like(logits).scatter(1, top_idx, top_gate)
    _, capacity_indices = torch.topk(topk_masked_gates, k=min_capacity, dim=0, sorted=False)
    return capacity_indices


def _gate_outputs(logits):
    from fixes.entries.moe_topk_gating_capacity_by_logits import reproduce

    got = reproduce.deepspeed_gating(logits)
    want = reproduce.reference_topk_gating(logits, reproduce.K, reproduce.CAPACITY_FACTOR, reproduce.MIN_CAPACITY)
    return got, want


def check_negative_logits_route_nothing_until_fixed_then_match_the_reference_in_each_dtype():
    import fixes
    import torch
    from fixes import harness
    from fixes.entries.moe_topk_gating_capacity_by_logits import reproduce

    _owner()
    shifted = reproduce.gating_logits("float32", shift=-4.0)
    got, want = _gate_outputs(shifted)
    assert reproduce.routed(got) == 0 and reproduce.routed(want) > 0, (reproduce.routed(got), reproduce.routed(want))
    fixes.apply(FIX_ID)
    for dtype in ("float32", "bfloat16"):
        for shift in (0.0, -4.0):
            got, want = _gate_outputs(reproduce.gating_logits(dtype, shift=shift))
            assert all(reproduce.gating_vs_reference(got, want).values()), (dtype, shift)
            assert harness.compare(got["combine_weights"], want["combine_weights"], dtype).close, (dtype, shift)
            assert harness.compare(got["l_aux"], want["l_aux"], dtype).close, (dtype, shift)
            assert got["combine_weights"].dtype == torch.float32
    fixes.revert(FIX_ID)


def check_the_fix_leaves_the_other_drop_paths_to_the_original():
    import fixes
    import torch
    from deepspeed.moe import sharded_moe
    from fixes.entries.moe_topk_gating_capacity_by_logits import reproduce

    _owner()
    logits = reproduce.gating_logits("float32", shift=-4.0)
    before = sharded_moe.topkgating(logits, 3, 1.0, 4, True, None, "position")
    fixes.apply(FIX_ID)
    after = sharded_moe.topkgating(logits, 3, 1.0, 4, True, None, "position")
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    fixes.revert(FIX_ID)


def check_a_moe_layer_built_before_the_fix_computes_the_reference_output():
    import fixes
    import torch
    from deepspeed.moe.layer import MoE
    from fixes import harness
    from fixes.entries.moe_topk_gating_capacity_by_logits.reproduce import reference_moe

    _owner()
    torch.manual_seed(0)
    moe = MoE(hidden_size=16, expert=torch.nn.Linear(16, 16), num_experts=8, k=3)
    for expert in moe.deepspeed_moe.experts.deepspeed_experts:
        expert.reset_parameters()
    x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(1000))
    with torch.no_grad():
        want, _ = reference_moe(moe, x)
        assert not harness.compare(moe(x)[0], want, "float32").close
        fixes.apply(FIX_ID)
        assert harness.compare(moe(x)[0], want, "float32").close
    fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.moe_topk_gating_capacity_by_logits import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, topkgating)


def test_when_logits_are_negative_then_nothing_is_routed_until_fixed_and_then_the_gate_equals_the_reference():
    call_in_release(AFFECTED, check_negative_logits_route_nothing_until_fixed_then_match_the_reference_in_each_dtype)


def test_when_drop_policy_is_position_then_the_fix_returns_what_the_original_returns():
    call_in_release(AFFECTED, check_the_fix_leaves_the_other_drop_paths_to_the_original)


def test_when_a_moe_layer_was_built_before_the_fix_then_its_output_equals_plain_pytorch_after_it():
    call_in_release(AFFECTED, check_a_moe_layer_built_before_the_fix_computes_the_reference_output)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
