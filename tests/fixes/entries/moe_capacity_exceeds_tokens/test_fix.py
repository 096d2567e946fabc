"""moe-capacity-exceeds-tokens: upstream PR #8155's cases, calls whose capacity fits left alone, a layer on 0.16.0 (a
scripted ``_top_idx``), and with moe-topk-gating-capacity-by-logits on 0.18.9."""
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
FIX_ID = "moe-capacity-exceeds-tokens"
OTHER_ID = "moe-topk-gating-capacity-by-logits"


def check_upstreams_cases_pass_and_calls_whose_capacity_fits_go_to_the_original():
    from deepspeed.moe import sharded_moe
    from fixes.entries.moe_capacity_exceeds_tokens import reproduce

    harness.setup()
    gates = reproduce.gate_functions()
    fits = [("topkgating", torch.randn(32, reproduce.EXPERTS, generator=torch.Generator().manual_seed(3)), 1.0, 4),
            ("top1gating", torch.randn(32, reproduce.TOP1_EXPERTS, generator=torch.Generator().manual_seed(4)), 0.5, 4)]
    before = [gates[name](logits, factor, minimum) for name, logits, factor, minimum in fits]
    assert int(before[0][2].sum()) < 32 * reproduce.K and int(before[1][2].sum()) < 32  # tokens were dropped
    fixes.apply(FIX_ID)
    try:
        for (name, logits, factor, minimum), old in zip(fits, before):
            assert all(torch.equal(a, b) for a, b in zip(old, gates[name](logits, factor, minimum))), name
        # upstream PR #8155's tests: the dispatch width stays the configured capacity, and every token is routed
        mask = sharded_moe.topkgating(torch.randn(8, 2), 2, capacity_factor=2.0, min_capacity=0, drop_policy="probs")[2]
        assert mask.shape[-1] == 16 and int(mask.sum()) == 16
        mask = sharded_moe.top1gating(torch.randn(8, 2), capacity_factor=4.0, min_capacity=0, drop_tokens=True,
                                      use_rts=False)[2]
        assert mask.shape[-1] == 16 and int(mask.sum()) == 8
        mask = sharded_moe.top1gating(torch.randn(3, 4), capacity_factor=8.0, min_capacity=0, drop_tokens=True,
                                      use_rts=False)[2]
        assert mask.shape[-1] == 6
        mask = sharded_moe.topkgating(torch.randn(4, 2), 1, capacity_factor=1.0, min_capacity=8,
                                      drop_policy="position")[2]
        assert mask.shape[-1] == 8
    finally:
        fixes.revert(FIX_ID)


def check_a_moe_layer_built_before_the_fix_equals_plain_pytorch_with_gradients():
    from fixes.entries.moe_capacity_exceeds_tokens import reproduce

    harness.setup()
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
                parameters = list(moe.parameters())
                grads = torch.autograd.grad(output.square().sum() + l_aux, [x] + parameters)
                want_grads = torch.autograd.grad(want.square().sum() + want_l_aux, [x_ref] + parameters)
                got = {"output": output, "l_aux": l_aux, **{str(i): g for i, g in enumerate(grads)}}
                expected = {"output": want, "l_aux": want_l_aux, **{str(i): g for i, g in enumerate(want_grads)}}
                assert harness.compare(got, expected, "float32").close, (label, training)
    finally:
        fixes.revert(FIX_ID)


def check_the_two_moe_fixes_compose_in_either_order():
    """This fix requires moe-topk-gating-capacity-by-logits, whose wrapper then sits under this one whichever is
    applied first: a short prompt does not crash, a long batch is not ranked by logits, revert restores."""
    from fixes.entries.moe_capacity_exceeds_tokens import _TOPK, reproduce
    from fixes.entries.moe_topk_gating_capacity_by_logits import reproduce as logits_entry

    harness.setup()
    owner = _TOPK.owner_and_name()[0]
    # the two patched names (torch.compile adds its own entries to the module's globals as the gates run)
    before = {name: vars(owner)[name] for name in ("topkgating", "_top_idx")}
    for order in ([FIX_ID], [FIX_ID, OTHER_ID], [OTHER_ID, FIX_ID]):
        outcomes = fixes.apply(*order)
        assert outcomes[0].action == "applied", outcomes
        assert fixes.get(OTHER_ID).applied and fixes.get(FIX_ID).applied, order
        assert reproduce.reproduce() is False and logits_entry.reproduce() is False, order
        with torch.no_grad():
            moe = reproduce.moe_layer().eval()
            x = reproduce.tokens()
            assert harness.compare(moe(x)[0], reproduce.reference_moe(moe, x)[0], "float32").close, order
        fixes.revert(FIX_ID, OTHER_ID)  # the outer wrapper first (reverting the required one first would drop it)
        assert not fixes.get(OTHER_ID).applied and not fixes.get(FIX_ID).applied, order
        assert all(vars(owner)[name] is original for name, original in before.items()), order
    assert reproduce.reproduce() is True


def test_when_applied_then_upstreams_cases_pass_and_calls_whose_capacity_fits_are_unchanged():
    call_in_release(AFFECTED, check_upstreams_cases_pass_and_calls_whose_capacity_fits_go_to_the_original)


def test_when_a_layer_was_built_before_the_fix_on_the_scripted_top_idx_release_then_it_equals_plain_pytorch():
    call_in_release("0.16.0", check_a_moe_layer_built_before_the_fix_equals_plain_pytorch_with_gradients)


def test_when_both_moe_fixes_are_applied_in_either_order_then_both_bugs_are_fixed():
    call_in_release("0.18.9", check_the_two_moe_fixes_compose_in_either_order)
