"""moe-capacity-exceeds-tokens on its reproduce release, on the oldest swept release (scripted ``_top_idx``, and
moe-topk-gating-capacity-by-logits' bug in the same branch), on that entry's reproduce release (the two fixes
together), and on the first fixed release and the newest, in child processes."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.19.3"
OLDEST_AFFECTED = "0.16.0"  # _top_idx is a torch.jit.script function there; topkgating ranks by logits
WITH_LOGITS_BUG = "0.18.9"  # moe-topk-gating-capacity-by-logits' reproduce release: both fixes apply
FIX_ID = "moe-capacity-exceeds-tokens"
OTHER_ID = "moe-topk-gating-capacity-by-logits"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.moe_capacity_exceeds_tokens import _TOPK

    return _TOPK.owner_and_name()[0]


def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
    """A drifted topkgating that still selects ``capacity`` rows over the tokens (and drops the rest of the gate)."""
    import torch

    capacity = max(min_capacity, logits.shape[0] // logits.shape[1] * k)
    _, capacity_indices = torch.topk(logits, k=capacity, dim=0, sorted=False)
    return capacity_indices


def check_gates_keep_every_token_and_the_capacity_and_match_the_reference_in_each_dtype():
    import fixes
    import torch
    from fixes import harness
    from fixes.entries.moe_capacity_exceeds_tokens import reproduce

    _owner()
    gates = reproduce.gate_functions()
    cases = [("topkgating", 3, 1.0, 4), ("topkgating", 2, 4.0, 0), ("top1gating", 6, 8.0, 4), ("top1gating", 3, 8.0, 0)]
    logits = {(name, count): torch.randn(count, reproduce.EXPERTS if name == "topkgating" else reproduce.TOP1_EXPERTS,
                                         generator=torch.Generator().manual_seed(count))
              for name, count, _, _ in cases}
    for name, count, factor, minimum in cases:
        assert reproduce.crashes(lambda: gates[name](logits[name, count], factor, minimum)) is not None, name
    fixes.apply(FIX_ID)
    try:
        for dtype in ("float32", "bfloat16"):
            for name, count, factor, minimum in cases:
                k = reproduce.K if name == "topkgating" else 1
                x = logits[name, count].to(harness.dtype_of(dtype)).clone().requires_grad_()
                y = x.detach().clone().requires_grad_()
                got = dict(zip(reproduce.GATE_OUTPUTS, gates[name](x, factor, minimum)))
                want = reproduce.reference_gating(y, k, factor, minimum)
                label = f"{name} {count} tokens {dtype}"
                slots = reproduce.capacity(count, x.shape[1], k, factor, minimum)
                assert slots > count and got["combine_weights"].shape == (count, x.shape[1], slots), label
                assert torch.equal(got["dispatch_mask"], want["dispatch_mask"]), label
                assert torch.equal(got["exp_counts"], want["exp_counts"]), label
                assert int(got["dispatch_mask"].sum()) == count * k, label  # nothing dropped
                for output in ("combine_weights", "l_aux"):
                    assert harness.compare(got[output], want[output], dtype).close, (label, output)
                weights = torch.randn(got["combine_weights"].shape, generator=torch.Generator().manual_seed(7))
                ((got["combine_weights"] * weights).sum() + got["l_aux"]).backward()
                ((want["combine_weights"] * weights).sum() + want["l_aux"]).backward()
                assert harness.compare(x.grad, y.grad, dtype).close, (label, "grad")
    finally:
        fixes.revert(FIX_ID)


def check_upstreams_cases_pass_with_the_fix():
    """Upstream PR #8155's tests: the dispatch width stays the configured capacity, and every token is routed."""
    import fixes
    import torch
    from deepspeed.moe import sharded_moe

    _owner()
    fixes.apply(FIX_ID)
    try:
        _, _, mask, _ = sharded_moe.topkgating(torch.randn(8, 2), 2, capacity_factor=2.0, min_capacity=0,
                                               drop_policy="probs")
        assert mask.shape[-1] == 16 and int(mask.sum()) == 16
        _, _, mask, _ = sharded_moe.top1gating(torch.randn(8, 2), capacity_factor=4.0, min_capacity=0,
                                               drop_tokens=True, use_rts=False)
        assert mask.shape[-1] == 16 and int(mask.sum()) == 8
        _, _, mask, _ = sharded_moe.top1gating(torch.randn(3, 4), capacity_factor=8.0, min_capacity=0,
                                               drop_tokens=True, use_rts=False)
        assert mask.shape[-1] == 6
        _, _, mask, _ = sharded_moe.topkgating(torch.randn(4, 2), 1, capacity_factor=1.0, min_capacity=8,
                                               drop_policy="position")
        assert mask.shape[-1] == 8
    finally:
        fixes.revert(FIX_ID)


def check_calls_whose_capacity_fits_go_to_the_original():
    """Where the capacity fits the tokens (tokens are dropped), the fixed gates return what the originals return."""
    import fixes
    import torch
    from fixes.entries.moe_capacity_exceeds_tokens import reproduce

    _owner()
    gates = reproduce.gate_functions()
    calls = [("topkgating", torch.randn(32, reproduce.EXPERTS, generator=torch.Generator().manual_seed(3)), 1.0, 4),
             ("top1gating", torch.randn(32, reproduce.TOP1_EXPERTS, generator=torch.Generator().manual_seed(4)), 0.5, 4)]
    before = [gates[name](logits, factor, minimum) for name, logits, factor, minimum in calls]
    fixes.apply(FIX_ID)
    try:
        after = [gates[name](logits, factor, minimum) for name, logits, factor, minimum in calls]
    finally:
        fixes.revert(FIX_ID)
    for (name, *_), old, new in zip(calls, before, after):
        assert all(torch.equal(a, b) for a, b in zip(old, new)), name
    assert int(before[0][2].sum()) < 32 * reproduce.K and int(before[1][2].sum()) < 32  # tokens were dropped


def check_a_moe_layer_built_before_the_fix_equals_plain_pytorch_with_gradients():
    import fixes
    import torch
    from fixes import harness
    from fixes.entries.moe_capacity_exceeds_tokens import reproduce

    _owner()
    layers = {"top-3": (reproduce.moe_layer(), reproduce.PROMPT_TOKENS),
              "top-1": (reproduce.top1_layer(), reproduce.TOP1_TOKENS)}
    fixes.apply(FIX_ID)
    try:
        for label, (moe, count) in layers.items():
            for training in (True, False):
                moe.train(training)
                x = reproduce.tokens(count).requires_grad_()
                x_ref = x.detach().clone().requires_grad_()
                output, l_aux, _ = moe(x)
                want, want_l_aux = reproduce.reference_moe(moe, x_ref)
                assert harness.compare({"output": output, "l_aux": l_aux}, {"output": want, "l_aux": want_l_aux},
                                       "float32").close, (label, training)
                parameters = list(moe.parameters())
                grads = torch.autograd.grad(output.square().sum() + l_aux, [x] + parameters)
                want_grads = torch.autograd.grad(want.square().sum() + want_l_aux, [x_ref] + parameters)
                assert harness.compare({str(i): g for i, g in enumerate(grads)},
                                       {str(i): g for i, g in enumerate(want_grads)}, "float32").close, (label, training)
    finally:
        fixes.revert(FIX_ID)


def check_the_two_moe_fixes_compose_in_either_order():
    """On a release with both bugs: this fix requires moe-topk-gating-capacity-by-logits, whose wrapper then sits
    under this one whichever is applied first; a top-3 layer then neither crashes on a short prompt nor ranks by
    logits on a long batch, and revert restores the original objects."""
    import fixes
    import torch
    from fixes import harness
    from fixes.entries.moe_topk_gating_capacity_by_logits import reproduce as logits_entry
    owner = _owner()
    from fixes.entries.moe_capacity_exceeds_tokens import reproduce

    # the two patched names (torch.compile adds its own entries to the module's globals as the gates run)
    before = {name: vars(owner)[name] for name in ("topkgating", "_top_idx")}
    for order in ([FIX_ID], [FIX_ID, OTHER_ID], [OTHER_ID, FIX_ID]):
        outcomes = fixes.apply(*order)
        assert outcomes[0].action == "applied", outcomes
        assert fixes.get(OTHER_ID).applied and fixes.get(FIX_ID).applied, order
        assert reproduce.reproduce() is False, order
        assert logits_entry.reproduce() is False, order  # the capacity cut ranks by probability
        with torch.no_grad():
            moe = reproduce.moe_layer().eval()
            x = reproduce.tokens()
            assert harness.compare(moe(x)[0], reproduce.reference_moe(moe, x)[0], "float32").close, order
        fixes.revert(FIX_ID, OTHER_ID)  # the outer wrapper first (reverting the required one first would drop it)
        assert not fixes.get(OTHER_ID).applied and not fixes.get(FIX_ID).applied, order
        assert all(vars(owner)[name] is original for name, original in before.items()), order
    assert reproduce.reproduce() is True


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.moe_capacity_exceeds_tokens import _TOPK

    owner, name = _TOPK.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, topkgating)


def test_when_capacity_exceeds_tokens_then_the_fixed_gates_keep_the_capacity_and_equal_the_reference():
    call_in_release(AFFECTED, check_gates_keep_every_token_and_the_capacity_and_match_the_reference_in_each_dtype)


def test_when_applied_then_upstreams_test_cases_pass():
    call_in_release(AFFECTED, check_upstreams_cases_pass_with_the_fix)


def test_when_the_capacity_fits_the_tokens_then_the_fix_returns_what_the_original_returns():
    call_in_release(AFFECTED, check_calls_whose_capacity_fits_go_to_the_original)


def test_when_a_layer_was_built_before_the_fix_then_its_output_and_gradients_equal_plain_pytorch():
    call_in_release(AFFECTED, check_a_moe_layer_built_before_the_fix_equals_plain_pytorch_with_gradients)
    call_in_release(OLDEST_AFFECTED, check_a_moe_layer_built_before_the_fix_equals_plain_pytorch_with_gradients)


def test_when_both_moe_fixes_are_applied_in_either_order_then_both_bugs_are_fixed():
    call_in_release(WITH_LOGITS_BUG, check_the_two_moe_fixes_compose_in_either_order)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
