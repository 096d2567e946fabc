"""How moe-capacity-exceeds-tokens is reproduced: the fast check the release sweep runs (``reproduce()``: True where
the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe.

Also what the notebook shares with it: the MoE layers of the user's model (:func:`moe_layer`, :func:`top1_layer`),
the crash it hits (:func:`crashes`), and the same gating and layer in plain PyTorch (:func:`reference_gating`,
:func:`reference_moe`). The reference covers the regime of this bug only, a capacity of at least the number of
tokens, where no token can be dropped: every token reaches each expert it chose.
"""
from __future__ import annotations

import math
from typing import Any

from ...harness.gating import GATE_OUTPUTS
from ...harness.gating import reference_moe as reference_layer

HIDDEN = 16
EXPERTS, K = 8, 3  # the user's layer: 8 experts, top-3 gating, MoE's default min_capacity = 4
TOP1_EXPERTS, TOP1_CAPACITY_FACTOR = 4, 8.0  # a top-1 layer whose capacity factor exceeds its experts
PROMPT_TOKENS = 3  # one short prompt: fewer tokens than the top-3 layer's capacity (min_capacity 4)
TOP1_TOKENS = 6  # top1gating asserts tokens >= min_capacity (4) first; capacity = ceil(6 / 4 * 8) = 12
# What torch says when topk is asked for more rows than there are: eagerly (and in TorchScript), and while
# torch.compile traces a compiled helper (top1gating's _top_idx where DeepSpeed compiles it).
CAPACITY_ERRORS = ("selected index k out of range", "k not in range for dimension")


def moe_layer(k: int = K, num_experts: int = EXPERTS, seed: int = 0, **options: Any) -> Any:
    """``deepspeed.moe.layer.MoE(hidden_size=16, expert=Linear(16, 16), num_experts, k, **options)`` as a user builds
    it, each expert re-initialised (``MoE`` makes them as copies of one module; a trained model's experts differ)."""
    import torch
    from deepspeed.moe.layer import MoE

    torch.manual_seed(seed)
    moe = MoE(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=num_experts, k=k, **options)
    for expert in moe.deepspeed_moe.experts.deepspeed_experts:
        expert.reset_parameters()
    return moe


def top1_layer(seed: int = 0) -> Any:
    """A top-1 layer with a capacity factor above its number of experts: capacity = ceil(tokens / 4 * 8) = 2 x tokens."""
    return moe_layer(k=1, num_experts=TOP1_EXPERTS, seed=seed, capacity_factor=TOP1_CAPACITY_FACTOR,
                     eval_capacity_factor=TOP1_CAPACITY_FACTOR)


def tokens(count: int = PROMPT_TOKENS, sequences: int = 1, seed: int = 1000) -> Any:
    """``sequences`` x ``count`` tokens of hidden size 16."""
    import torch

    return torch.randn(sequences, count, HIDDEN, generator=torch.Generator().manual_seed(seed))


def capacity_error(exc: BaseException) -> str | None:
    """``"<exception type>: <torch's words>"`` if ``exc`` is topk's refusal to select more rows than there are
    (the message's other lines, which name tensors and addresses, left out), else None."""
    text = str(exc)
    for words in CAPACITY_ERRORS:
        if words in text:
            return f"{type(exc).__name__}: {words}"
    return None


def crashes(call: Any) -> str | None:
    """Run ``call()``: the capacity error it raises (see :func:`capacity_error`), None if it runs. Any other error
    propagates. While it runs, torch's fake-tensor logger is kept quiet: where ``torch.compile`` traces the helper,
    it logs the same error with a timestamp and a stack before raising it."""
    import logging

    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - sorted below
        error = capacity_error(exc)
        if error is None:
            raise
        return error
    finally:
        quiet.setLevel(level)
    return None


def capacity(count: int, experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """The gate's capacity per expert: ``max(ceil(tokens / experts * capacity_factor * k), min_capacity)``."""
    return max(math.ceil(count / experts * capacity_factor * k), min_capacity)


def reference_gating(logits: Any, k: int, capacity_factor: float, min_capacity: int) -> dict[str, Any]:
    """Top-k gating with a capacity of at least the number of tokens, in plain PyTorch, as
    ``deepspeed.moe.sharded_moe`` defines it (top-1: ``top1gating``; k > 2: ``topkgating``):

    1. ``gates = softmax(logits)`` per token (in the logits' dtype); each token chooses its ``k`` most probable
       experts; ``exp_counts``: how many tokens chose each expert.
    2. ``capacity = max(ceil(tokens / experts * capacity_factor * k), min_capacity)`` slots per expert; it is at
       least the number of tokens here, so every token keeps every expert it chose, in the slot given by how many
       tokens before it chose the same expert.
    3. A token's weights: top-1, its probability; k > 2, its k probabilities renormalised to sum 1 (the sum clamped
       at the dtype's eps). ``l_aux``: ``sum_e(mean_s gates * fraction choosing e) * E`` for top-1,
       ``mean_e(...) * E * E / k`` for k > 2.

    Returns ``l_aux``, ``combine_weights`` [tokens, experts, capacity] (float32), ``dispatch_mask`` (bool),
    ``exp_counts``. Differentiable in ``logits`` as DeepSpeed's outputs are."""
    import torch

    count, experts = logits.shape
    slots = capacity(count, experts, k, capacity_factor, min_capacity)
    if slots < count:
        raise ValueError(f"the reference covers capacity >= tokens only; capacity {slots} < {count} tokens")
    gates = torch.softmax(logits, dim=1)
    chosen = torch.zeros_like(gates, dtype=torch.bool).scatter(1, torch.topk(gates, k=k, dim=1).indices, True)
    exp_counts = chosen.sum(dim=0)
    share = gates.mean(dim=0) * chosen.float().mean(dim=0)
    if k == 1:
        l_aux = torch.sum(share) * experts
        weights = gates * chosen.float()
    else:
        l_aux = torch.mean(share) * experts * experts / k
        weights = gates * chosen
        weights = weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).eps)
    slot = (chosen.long().cumsum(dim=0) - 1).clamp(min=0)
    dispatch_mask = torch.nn.functional.one_hot(slot, slots).bool() & chosen.unsqueeze(-1)
    combine_weights = weights.float().unsqueeze(-1) * dispatch_mask
    return {"l_aux": l_aux, "combine_weights": combine_weights, "dispatch_mask": dispatch_mask,
            "exp_counts": exp_counts}


def reference_moe(moe: Any, hidden_states: Any) -> tuple[Any, Any]:
    """A ``deepspeed.moe.layer.MoE`` layer (ep_size 1, no residual, top-1 or k > 2) computed in plain PyTorch from
    its own parameters, for a capacity of at least the number of tokens: the gate's logits ``tokens @ wg.T`` in
    fp32, :func:`reference_gating` (with the capacity factor of the layer's mode), then each token's output is the
    weighted sum of the experts it chose applied to it. Returns (output, l_aux), differentiable in the layer's
    parameters and ``hidden_states`` (:func:`fixes.harness.gating.reference_moe`)."""
    def gating(logits: Any, gate: Any) -> dict[str, Any]:
        capacity_factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
        return reference_gating(logits, gate.k, capacity_factor, gate.min_capacity)

    return reference_layer(moe, hidden_states, gating)


def top_idx_source() -> str | None:
    """The source of ``deepspeed.moe.sharded_moe._top_idx``, the helper ``top1gating`` selects with (a
    ``torch.jit.script`` function keeps its Python function as ``_torchdynamo_inline``); None where the module has
    no such helper (``top1gating`` then calls ``torch.topk`` itself)."""
    import inspect

    from deepspeed.moe import sharded_moe

    helper = getattr(sharded_moe, "_top_idx", None)
    if helper is None:
        return None
    helper = inspect.unwrap(helper)
    return inspect.getsource(getattr(helper, "_torchdynamo_inline", helper))


def gate_functions() -> dict[str, Any]:
    """The two gate functions with the bug, called as ``TopKGate.forward`` calls them with ``drop_tokens=True``
    (top-1 without random token selection, so a call is deterministic), looked up in the module at call time."""
    from deepspeed.moe import sharded_moe

    return {
        "top1gating": lambda logits, capacity_factor, min_capacity: sharded_moe.top1gating(
            logits, capacity_factor, min_capacity, None, None, True, False),
        "topkgating": lambda logits, capacity_factor, min_capacity: sharded_moe.topkgating(
            logits, K, capacity_factor, min_capacity, True, None),
    }


def reproduce() -> bool:
    """A top-3 ``MoE`` layer (8 experts, default min_capacity 4) on a 3-token prompt, and a top-1 layer (4 experts,
    capacity factor 8) on 6 tokens, in eval: True if both crash with topk's capacity error, False if both run;
    CannotTellError if only one does (upstream fixed both together)."""
    import torch

    from ...exceptions import CannotTellError

    with torch.no_grad():
        topk = crashes(lambda: moe_layer().eval()(tokens()))
        top1 = crashes(lambda: top1_layer().eval()(tokens(TOP1_TOKENS)))
    if (topk is None) != (top1 is None):
        raise CannotTellError(f"only one gate crashes: top-3 {topk or 'runs'}, top-1 {top1 or 'runs'}")
    return topk is not None


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the user's top-3 layer on a 3-token prompt (capacity 4), then
    top-2 gating instead (``top2gating`` cuts by position with ``torch.lt``, no ``torch.topk`` over the tokens). Does
    the layer crash with topk's capacity error? The top-1 case (a capacity factor above the number of experts) is
    in the trigger's note: ``fixes.trigger`` has no use for top-1 MoE gating."""
    import torch

    from ...harness import Cell, trigger_job

    def crashed(k: int) -> bool:
        with torch.no_grad():
            return crashes(lambda: moe_layer(k=k).eval()(tokens())) is not None

    return [Cell("MoE top-3 gating, a 3-token prompt", trigger_job({}, uses=["moe-top-k"]), lambda: crashed(K)),
            Cell("top-2 gating instead", trigger_job({}), lambda: crashed(2), "uses:moe-top-k")]
