"""How moe-topk-gating-capacity-by-logits is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe.

Also what the notebook shares with it: the plain-PyTorch reference gate (:func:`reference_topk_gating`), the
same MoE layer computed in plain PyTorch (:func:`reference_moe`), the logits it is fed
(:func:`gating_logits`) and the comparison of DeepSpeed's gate outputs with the reference (:func:`gating_vs_reference`).
"""
from __future__ import annotations

import math
from typing import Any

from ...harness.gating import GATE_OUTPUTS, AmbiguousGate, choose_experts, gate_outputs, gating_vs_reference
from ...harness.gating import reference_moe as reference_layer

TOKENS, EXPERTS, K = 32, 8, 3  # the sweep's gate: 32 tokens, 8 experts, top-3
CAPACITY_FACTOR, MIN_CAPACITY = 1.0, 4  # capacity = max(ceil(3 * 32 / 8 * 1.0), 4) = 12 tokens per expert


class AmbiguousCut(AmbiguousGate):
    """Two gate probabilities tie exactly at an expert's capacity-th and (capacity+1)-th token: which one is kept
    is then up to ``torch.topk``'s tie order, not the documented semantics, so the reference refuses to choose
    (a tie at a token's k-th expert raises the harness's :class:`AmbiguousGate`)."""


def reference_topk_gating(logits: Any, k: int, capacity_factor: float, min_capacity: int) -> dict[str, Any]:
    """Top-k gating with token dropping, the ``drop_policy='probs'`` semantics, in plain PyTorch.

    1. ``gates = softmax(logits)`` per token (in the logits' dtype); each token chooses its ``k`` most
       probable experts. ``exp_counts``: how many tokens chose each expert; ``l_aux``: the load-balancing
       loss ``mean_e(mean_s gates * fraction of tokens choosing e) * E * E / k``.
    2. ``capacity = max(ceil(k * tokens / experts * capacity_factor), min_capacity)``. Each expert keeps, of
       the tokens that chose it, the ``capacity`` ones with the highest gate *probability*.
    3. A token's weights: its kept probabilities, renormalised to sum 1 (the sum clamped at the dtype's eps).
       Its slot in an expert's buffer: how many kept tokens of that expert come before it.

    Returns the four outputs of ``deepspeed.moe.sharded_moe.topkgating``: ``combine_weights`` [tokens,
    experts, capacity] (float32, as DeepSpeed's einsum with its float one-hot gives), ``dispatch_mask`` (bool,
    same shape), ``l_aux``, ``exp_counts``. Raises :class:`AmbiguousGate` (:class:`AmbiguousCut` at a capacity) on an
    exact tie at a cut. Steps 1 and 3 are the harness's (:mod:`fixes.harness.gating`).
    """
    import torch

    choice = choose_experts(logits, k)
    tokens, experts = logits.shape
    capacity = max(math.ceil(k * tokens / experts * capacity_factor), min_capacity)
    kept = torch.zeros_like(choice.chosen)
    for expert in range(experts):
        candidates = choice.chosen[:, expert].nonzero().flatten()
        by_probability = torch.sort(choice.gates[candidates, expert], descending=True, stable=True)
        if len(candidates) > capacity and by_probability.values[capacity - 1] == by_probability.values[capacity]:
            raise AmbiguousCut(f"expert {expert}: the capacity-th and next gate probabilities are equal")
        kept[candidates[by_probability.indices[:capacity]], expert] = True
    return gate_outputs(choice, kept, capacity)


def gating_logits(dtype: Any = "float32", tokens: int = TOKENS, experts: int = EXPERTS, k: int = K,
                  shift: float = 0.0, seed: int = 0) -> Any:
    """Random gate logits ``randn(tokens, experts) + shift`` in ``dtype``, from the first seed at or after
    ``seed`` whose probabilities have no exact tie at a cut (bfloat16 rounds many apart values together):
    both the reference and DeepSpeed then have one right answer. ``shift`` moves every logit by the same
    amount, which changes no probability."""
    import torch

    from ...harness import dtype_of

    for attempt in range(seed, seed + 100):
        logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(attempt))
        logits = (logits + shift).to(dtype_of(dtype))
        try:
            reference_topk_gating(logits, k, CAPACITY_FACTOR, MIN_CAPACITY)
        except AmbiguousGate:
            continue
        return logits
    raise RuntimeError(f"no tie-free {dtype} logits in 100 seeds from {seed}")


def deepspeed_gating(logits: Any, k: int = K) -> dict[str, Any]:
    """``deepspeed.moe.sharded_moe.topkgating`` as ``TopKGate.forward`` calls it for k > 2 (drop_tokens=True,
    so the default ``drop_policy='probs'``), looked up in the module at call time, as ``TopKGate`` does."""
    from deepspeed.moe import sharded_moe

    outputs = sharded_moe.topkgating(logits, k, CAPACITY_FACTOR, MIN_CAPACITY, True, None)
    return dict(zip(GATE_OUTPUTS, outputs))


def routed(outputs: dict[str, Any]) -> int:
    """How many (token, expert) pairs reach an expert."""
    return int(outputs["dispatch_mask"].sum())


def routing_table(got: dict[str, Any], want: dict[str, Any]) -> list[dict[str, int]]:
    """Per expert: how many tokens chose it, its capacity, how many DeepSpeed kept, how many the reference
    kept (the most probable), and how many of DeepSpeed's are not among the reference's."""
    kept_by_deepspeed, kept_by_reference = got["dispatch_mask"].any(-1), want["dispatch_mask"].any(-1)
    return [{"expert": expert, "chose it": int(want["exp_counts"][expert]), "capacity": int(want["dispatch_mask"].shape[-1]),
             "kept (DeepSpeed)": int(kept_by_deepspeed[:, expert].sum()),
             "kept (most probable)": int(kept_by_reference[:, expert].sum()),
             "kept but not among the most probable": int((kept_by_deepspeed[:, expert] & ~kept_by_reference[:, expert]).sum())}
            for expert in range(want["dispatch_mask"].shape[1])]


def reference_moe(moe: Any, hidden_states: Any) -> tuple[Any, Any]:
    """A ``deepspeed.moe.layer.MoE`` layer (ep_size 1, no residual) computed in plain PyTorch from its own
    parameters: the gate's logits ``tokens @ wg.T`` in fp32, :func:`reference_topk_gating` (with the gate's
    capacity factor for training or evaluation), then each token's output is the weighted sum of its kept experts
    applied to it (:func:`fixes.harness.gating.reference_moe`). Returns (output, l_aux)."""
    def gating(logits: Any, gate: Any) -> dict[str, Any]:
        capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        return reference_topk_gating(logits, gate.k, capacity_factor, gate.min_capacity)

    return reference_layer(moe, hidden_states, gating)


def reproduce() -> bool:
    """``topkgating`` on 32 tokens x 8 experts, top-3, as ``TopKGate`` calls it: True if the tokens it sends to
    the experts (its dispatch mask) are not the reference's, which keeps each expert's most probable tokens."""
    got = deepspeed_gating(gating_logits())
    want = reference_topk_gating(gating_logits(), K, CAPACITY_FACTOR, MIN_CAPACITY)
    return not all(gating_vs_reference(got, want).values())


SHIFT = -3.0  # a constant added to every logit (no gate probability changes): most logits turn negative


def gate_as_topkgate_calls(logits: Any, k: int) -> dict[str, Any]:
    """The gate function ``TopKGate.forward`` picks for ``k`` in training (k = 2: ``top2gating``, with its default
    second-expert sampling; k > 2: ``topkgating``), called with the sweep's capacity on a copy of ``logits``
    (``top2gating`` adds its Gumbel noise in place), from a fixed random state."""
    import torch
    from deepspeed.moe import sharded_moe

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if k == 2:
            outputs = sharded_moe.top2gating(logits.clone(), CAPACITY_FACTOR, MIN_CAPACITY, True, None, True)
        else:
            outputs = sharded_moe.topkgating(logits.clone(), k, CAPACITY_FACTOR, MIN_CAPACITY, True, None)
    return dict(zip(GATE_OUTPUTS, outputs))


def routing_moves_with_shift(k: int, shift: float = SHIFT) -> bool:
    """True if the gate ``TopKGate`` uses for ``k`` routes other tokens (another dispatch mask) when every logit is
    shifted by ``shift``: the gate probabilities are the same, so a gate that ranks by probability cannot move."""
    import torch

    logits = gating_logits(k=k)
    return not torch.equal(gate_as_topkgate_calls(logits, k)["dispatch_mask"],
                           gate_as_topkgate_calls(logits + shift, k)["dispatch_mask"])


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's gate (32 tokens, 8 experts, capacity 12) with
    top-3 gating, then top-2, the gate ``TopKGate`` builds for k = 2 (``top2gating``). The measure is the one the
    summary names, which holds for either gate: does shifting every logit by -3 (no gate probability changes)
    change which tokens reach the experts? The sweep's check (the probability ranking of the reference) does not
    carry over to k = 2, whose documented capacity cut keeps tokens by position, not by probability."""
    from ...harness import Cell, trigger_job

    return [Cell("MoE top-3 gating", trigger_job({}, uses=["moe-top-k"]), lambda: routing_moves_with_shift(K)),
            Cell("top-2 gating instead", trigger_job({}), lambda: routing_moves_with_shift(2), "uses:moe-top-k")]
