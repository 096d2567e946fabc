"""How moe-topk-gating-no-drop-unbound-locations is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook,
never by the fix or its probe.

Also what the notebook shares with it: the user's layer (:func:`moe_layer`, ``MoE(..., k=3, drop_tokens=False)``),
the plain-PyTorch reference gate without token dropping (:func:`reference_topk_gating`), the same layer computed in
plain PyTorch (:func:`reference_moe`), the logits the gate is fed directly (:func:`gating_logits`) and
``topkgating`` called as ``TopKGate`` calls it (:func:`deepspeed_gating`).
"""
from __future__ import annotations

from typing import Any, Callable

from ...harness.gating import GATE_OUTPUTS, AmbiguousGate, choose_experts, gate_outputs, gating_vs_reference
from ...harness.gating import reference_moe as reference_layer

TOKENS, EXPERTS, K, HIDDEN = 32, 8, 3, 16  # the sweep's layer: 32 tokens, 8 experts, top-3, hidden size 16
CAPACITY_FACTOR, MIN_CAPACITY = 1.0, 4  # what MoE passes by default; without token dropping neither is used
ERROR = "UnboundLocalError"


def reference_topk_gating(logits: Any, k: int) -> dict[str, Any]:
    """Top-k gating without token dropping, in plain PyTorch.

    1. ``gates = softmax(logits)`` per token (in the logits' dtype); each token chooses its ``k`` most probable
       experts. ``exp_counts``: how many tokens chose each expert; ``l_aux``: the load-balancing loss
       ``mean_e(mean_s gates * fraction of tokens choosing e) * E * E / k``.
    2. Nothing is dropped: an expert's buffer holds as many tokens as the busiest expert got
       (``capacity = max(exp_counts)``; one process, no tensor parallelism).
    3. A token's weights: its chosen probabilities, renormalised to sum 1 (the sum clamped at the dtype's eps). Its
       slot in an expert's buffer: how many tokens that chose the expert come before it.

    Returns the four outputs of ``deepspeed.moe.sharded_moe.topkgating``: ``combine_weights`` [tokens, experts,
    capacity] (float32, as DeepSpeed's einsum with its float one-hot gives), ``dispatch_mask`` (bool, same shape),
    ``l_aux``, ``exp_counts``. Raises :class:`~fixes.harness.gating.AmbiguousGate` on an exact tie at the k-th
    expert. Steps 1 and 3 are the harness's (:mod:`fixes.harness.gating`).
    """
    choice = choose_experts(logits, k)
    return gate_outputs(choice, choice.chosen, int(choice.exp_counts.max()))


def gating_logits(dtype: Any = "float32", tokens: int = TOKENS, experts: int = EXPERTS, k: int = K,
                  seed: int = 0) -> Any:
    """Random gate logits ``randn(tokens, experts)`` in ``dtype``, from the first seed at or after ``seed`` whose
    probabilities have no exact tie at a token's k-th expert (bfloat16 rounds many apart values together)."""
    import torch

    from ...harness import dtype_of

    for attempt in range(seed, seed + 100):
        logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(attempt)).to(dtype_of(dtype))
        try:
            reference_topk_gating(logits, k)
        except AmbiguousGate:
            continue
        return logits
    raise RuntimeError(f"no tie-free {dtype} logits in 100 seeds from {seed}")


def deepspeed_gating(logits: Any, k: int = K) -> dict[str, Any]:
    """``deepspeed.moe.sharded_moe.topkgating`` as ``TopKGate.forward`` calls it for k > 2 with
    ``drop_tokens=False`` (no ``ep_group`` on one process), looked up in the module at call time, as ``TopKGate``
    does."""
    from deepspeed.moe import sharded_moe

    outputs = sharded_moe.topkgating(logits, k, CAPACITY_FACTOR, MIN_CAPACITY, False, None)
    return dict(zip(GATE_OUTPUTS, outputs))


def moe_layer(k: int = K, drop_tokens: bool = False, seed: int = 0) -> Any:
    """The user's layer: ``deepspeed.moe.layer.MoE(hidden_size=16, expert=Linear(16, 16), num_experts=8, k=k,
    drop_tokens=drop_tokens)``, everything else default, on the harness's device. ``MoE`` makes its experts as
    copies of the one ``expert`` module it is given; each is re-initialised, as the experts of a model in
    training differ."""
    import torch
    from deepspeed.moe.layer import MoE

    from ...harness import device

    torch.manual_seed(seed)
    moe = MoE(hidden_size=HIDDEN, expert=torch.nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, k=k,
              drop_tokens=drop_tokens)
    for expert in moe.deepspeed_moe.experts.deepspeed_experts:
        expert.reset_parameters()
    return moe.to(device())


def tokens(seed: int = 1000) -> Any:
    """4 sequences of 8 tokens (32 tokens for the gate), hidden size 16, on the harness's device."""
    import torch

    from ...harness import device

    return torch.randn(4, TOKENS // 4, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(device())


def reference_moe(moe: Any, hidden_states: Any) -> tuple[Any, Any]:
    """A ``deepspeed.moe.layer.MoE`` layer (ep_size 1, no residual, ``drop_tokens=False``) computed in plain
    PyTorch from its own parameters: the gate's logits ``tokens @ wg.T`` in fp32, :func:`reference_topk_gating`,
    then each token's output is the weighted sum of its chosen experts applied to it
    (:func:`fixes.harness.gating.reference_moe`). Returns (output, l_aux)."""
    return reference_layer(moe, hidden_states, lambda logits, gate: reference_topk_gating(logits, gate.k))


def forward_error(call: Callable[[], Any]) -> BaseException | None:
    """``call()``'s UnboundLocalError about ``locations`` (this bug), or None if it ran. Any other error says
    nothing about this bug: CannotTellError."""
    from ...exceptions import CannotTellError

    try:
        call()
    except UnboundLocalError as exc:
        if "locations" not in str(exc):
            raise CannotTellError(f"the MoE layer failed: UnboundLocalError: {exc}") from exc
        return exc
    except Exception as exc:  # noqa: BLE001 - anything else says nothing about this bug
        raise CannotTellError(f"the MoE layer failed: {type(exc).__name__}: {exc}") from exc
    return None


def reproduce() -> bool:
    """The user's layer, ``MoE(..., k=3, drop_tokens=False)``, on 32 tokens: True if its forward pass raises
    UnboundLocalError for ``locations``. Where it runs, its output must be the plain-PyTorch layer's (float32
    tolerance), else CannotTellError: a wrong output there is not this bug."""
    import torch

    from ...exceptions import CannotTellError
    from ...harness import compare

    moe, x = moe_layer(), tokens()
    outputs: list[Any] = []
    with torch.no_grad():
        if forward_error(lambda: outputs.append(moe(x))) is not None:
            return True
        want, _ = reference_moe(moe, x)
    comparison = compare(outputs[0][0], want, "float32")
    if not comparison.close:
        raise CannotTellError(f"the MoE layer ran without token dropping but its output is not top-k gating's: "
                              f"{comparison}")
    return False


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the user's layer (top-3 gating, ``drop_tokens=False``),
    then top-2 gating instead (``TopKGate`` calls ``top2gating`` for k = 2, whose no-drop branch is complete).
    Does the layer's forward pass raise the UnboundLocalError? Token dropping on (the default) is in the trigger's
    note: ``drop_tokens`` is an argument of the layer, not a config key, and ``fixes.trigger`` has no use for it.
    """
    import torch

    from ...harness import Cell, trigger_job

    def crashed(k: int) -> bool:
        moe, x = moe_layer(k=k), tokens()
        with torch.no_grad():
            return forward_error(lambda: moe(x)) is not None

    return [Cell("MoE top-3 gating, drop_tokens=False", trigger_job({}, uses=["moe-top-k"]), lambda: crashed(K)),
            Cell("top-2 gating instead", trigger_job({}), lambda: crashed(2), "uses:moe-top-k")]
