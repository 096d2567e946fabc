from types import SimpleNamespace

import pytest
import torch

from fixes.harness.gating import AmbiguousGate, choose_experts, gate_outputs, gating_vs_reference, reference_moe


def logits(tokens=16, experts=4, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))


def test_when_each_token_chooses_then_it_has_its_k_most_probable_experts_and_the_counts_add_up():
    choice = choose_experts(logits(), 2)
    assert choice.chosen.sum(dim=1).tolist() == [2] * 16
    best_two = torch.topk(choice.gates, 2, dim=1).indices
    assert torch.equal(choice.chosen, torch.zeros_like(choice.chosen).scatter(1, best_two, True))
    assert choice.exp_counts.tolist() == choice.chosen.sum(dim=0).tolist() and int(choice.exp_counts.sum()) == 32
    # topkgating's load-balancing loss: mean over experts of (mean gate) x (fraction of tokens choosing it), x E * E / k
    share = [float(choice.gates[:, e].mean()) * float(choice.chosen[:, e].float().mean()) for e in range(4)]
    assert float(choice.l_aux) == pytest.approx(sum(share) / 4 * 4 * 4 / 2)


def test_when_two_probabilities_tie_at_the_kth_expert_then_the_reference_refuses_to_choose():
    tied = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    with pytest.raises(AmbiguousGate):
        choose_experts(tied, 2)
    assert choose_experts(tied, 1).chosen.tolist() == [[True, False, False, False]]


def test_when_every_choice_is_kept_then_each_token_has_one_slot_per_expert_and_weights_sum_to_one():
    choice = choose_experts(logits(), 2)
    out = gate_outputs(choice, choice.chosen, int(choice.exp_counts.max()))
    assert torch.equal(out["dispatch_mask"].sum(dim=-1).bool(), choice.chosen)
    assert int(out["dispatch_mask"].sum(dim=0).max()) == 1  # a slot holds one token
    torch.testing.assert_close(out["combine_weights"].sum(dim=(1, 2)), torch.ones(16))
    for expert in range(4):  # slots in token order
        slots = out["dispatch_mask"][:, expert].nonzero()[:, 1]
        assert slots.tolist() == list(range(int(choice.exp_counts[expert])))


def test_when_a_token_is_dropped_then_its_weight_goes_to_its_other_expert_and_the_masks_differ():
    choice = choose_experts(logits(), 2)
    kept = choice.chosen.clone()
    first = int(kept[0].nonzero()[0])
    kept[0, first] = False
    full = gate_outputs(choice, choice.chosen, int(choice.exp_counts.max()))
    dropped = gate_outputs(choice, kept, int(choice.exp_counts.max()))
    assert float(dropped["combine_weights"][0].sum()) == pytest.approx(1.0)
    assert float(dropped["combine_weights"][0, first].sum()) == 0.0
    assert gating_vs_reference(dropped, full) == {"dispatch_mask": False, "exp_counts": True}
    assert gating_vs_reference(full, full) == {"dispatch_mask": True, "exp_counts": True}


def test_when_a_layer_is_computed_then_each_token_gets_its_experts_weighted_by_the_gate():
    torch.manual_seed(0)
    experts = [torch.nn.Linear(6, 6) for _ in range(4)]
    gate = SimpleNamespace(wg=torch.nn.Linear(6, 4, bias=False), k=1)
    moe = SimpleNamespace(deepspeed_moe=SimpleNamespace(gate=gate, experts=SimpleNamespace(deepspeed_experts=experts)))
    hidden = torch.randn(2, 5, 6)

    def top1(gate_logits, seen_gate):
        assert seen_gate is gate
        choice = choose_experts(gate_logits, seen_gate.k)
        return gate_outputs(choice, choice.chosen, int(choice.exp_counts.max()))

    output, l_aux = reference_moe(moe, hidden, top1)
    flat = hidden.reshape(10, 6)
    best = (flat @ gate.wg.weight.t()).argmax(dim=1)
    want = torch.stack([experts[int(e)](token) for e, token in zip(best, flat)])  # top-1: weight 1 after renormalising
    torch.testing.assert_close(output, want.reshape(2, 5, 6))
    assert l_aux.shape == ()
