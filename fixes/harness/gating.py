"""Top-k MoE gating in plain PyTorch: the reference that entries about ``deepspeed.moe.sharded_moe`` gates share.

An entry builds its reference gate from two steps: :func:`choose_experts` (softmax, each token's ``k`` most probable
experts, the counts and the load-balancing loss) and :func:`gate_outputs` (which of the chosen tokens each expert
keeps, given by the entry, turned into ``topkgating``'s four outputs). :func:`reference_moe` computes a whole
``deepspeed.moe.layer.MoE`` layer from its own parameters with such a gate; :func:`gating_vs_reference` compares
gate outputs exactly.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

GATE_OUTPUTS = ("l_aux", "combine_weights", "dispatch_mask", "exp_counts")  # what topkgating returns, in its order


class AmbiguousGate(ValueError):
    """Two gate probabilities tie exactly at a cut (a token's k-th and (k+1)-th expert; an entry's own cuts raise
    subclasses): which one is kept is then up to ``torch.topk``'s tie order, so the reference refuses to choose."""


class Choice(NamedTuple):
    """Each token's choice: ``gates`` [tokens, experts] (softmax, the logits' dtype), ``chosen`` (bool, same shape:
    the token's ``k`` most probable experts), ``exp_counts`` (tokens per expert) and ``l_aux``."""
    gates: Any
    chosen: Any
    exp_counts: Any
    l_aux: Any


def choose_experts(logits: Any, k: int) -> Choice:
    """``gates = softmax(logits)`` per token; each token chooses its ``k`` most probable experts.
    ``l_aux = mean_e(mean_s gates * fraction of tokens choosing e) * E * E / k``, the load-balancing loss of
    ``topkgating``. Raises :class:`AmbiguousGate` on an exact tie at a token's k-th expert."""
    import torch

    experts = logits.shape[1]
    gates = torch.softmax(logits, dim=1)
    by_token = torch.sort(gates, dim=1, descending=True, stable=True)
    if k < experts and bool((by_token.values[:, k - 1] == by_token.values[:, k]).any()):
        raise AmbiguousGate("a token's k-th and (k+1)-th gate probabilities are equal")
    chosen = torch.zeros_like(gates, dtype=torch.bool).scatter(1, by_token.indices[:, :k], True)
    l_aux = torch.mean(gates.mean(dim=0) * chosen.float().mean(dim=0)) * experts * experts / k
    return Choice(gates, chosen, chosen.sum(dim=0), l_aux)


def gate_outputs(choice: Choice, kept: Any, capacity: int) -> dict[str, Any]:
    """``topkgating``'s outputs when each expert keeps the tokens ``kept`` marks (bool [tokens, experts], a subset
    of ``choice.chosen``) in a buffer of ``capacity`` slots. A token's weights: its kept probabilities,
    renormalised to sum 1 (the sum clamped at the dtype's eps); its slot in an expert's buffer: how many kept tokens
    of that expert come before it. ``combine_weights`` [tokens, experts, capacity] is float32, as DeepSpeed's einsum
    with its float one-hot gives; ``dispatch_mask`` is bool, same shape."""
    import torch

    weights = choice.gates * kept
    weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    slots = kept.long().cumsum(dim=0) - 1
    dispatch_mask = torch.nn.functional.one_hot(slots.clamp(min=0), capacity).bool() & kept.unsqueeze(-1)
    combine_weights = weights.float().unsqueeze(-1) * dispatch_mask
    return {"l_aux": choice.l_aux, "combine_weights": combine_weights, "dispatch_mask": dispatch_mask,
            "exp_counts": choice.exp_counts}


def gating_vs_reference(got: dict[str, Any], want: dict[str, Any]) -> dict[str, bool]:
    """Which gate outputs are exactly equal: the masks and counts must be, bit for bit."""
    import torch

    return {name: bool(got[name].shape == want[name].shape and torch.equal(got[name], want[name]))
            for name in ("dispatch_mask", "exp_counts")}


def reference_moe(moe: Any, hidden_states: Any, gating: Callable[[Any, Any], dict[str, Any]]) -> tuple[Any, Any]:
    """A ``deepspeed.moe.layer.MoE`` layer (ep_size 1, no residual) computed in plain PyTorch from its own
    parameters: the gate's logits ``tokens @ wg.T`` in fp32, the reference gate ``gating(logits, moe's TopKGate)``,
    then each token's output is the weighted sum of its kept experts applied to it. Returns (output, l_aux)."""
    import torch

    layer = moe.deepspeed_moe
    gate, experts = layer.gate, layer.experts.deepspeed_experts
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    logits = flat.float() @ gate.wg.weight.float().t()
    gated = gating(logits, gate)
    weights = gated["combine_weights"].sum(dim=-1).to(flat.dtype)  # [tokens, experts]: zero where not kept
    output = torch.zeros_like(flat)
    for index, expert in enumerate(experts):
        output = output + weights[:, index:index + 1] * expert(flat)
    return output.reshape(hidden_states.shape), gated["l_aux"]
