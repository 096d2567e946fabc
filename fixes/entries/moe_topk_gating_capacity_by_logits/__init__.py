"""Fix for moe-topk-gating-capacity-by-logits: wraps ``deepspeed.moe.sharded_moe.topkgating``.

The wrapper handles the one path that has the bug, ``drop_tokens=True`` with ``drop_policy='probs'`` (what
``TopKGate.forward`` always asks for when k > 2: it passes no ``drop_policy``), with upstream PR #7986's code:
the per-token top-k and the per-expert capacity ranking are taken on the softmax probabilities instead of the
logits, and the capacity mask is built as a bool mask. Every other call (``drop_tokens=False``,
``drop_policy='position'``) goes to the release's own function unchanged. The capacity and the one-hot come
from the module's own ``_capacity`` and ``_one_hot_to_float``, as in the original. ``TopKGate.forward`` looks
``topkgating`` up in the module when it runs, so patching the module attribute fixes every ``MoE`` /
``TopKGate`` layer, including those built before ``fixes.apply``.

The probe reads ``topkgating``'s source: it follows the tensor that ``torch.topk(..., dim=0)`` ranks for the
capacity cut back through its assignments, and the code is affected when that tensor comes from the
``logits`` parameter rather than from ``softmax``.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_TARGET = Target("deepspeed.moe.sharded_moe", "topkgating")


class MoeTopkGatingCapacityByLogits(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        import_target_module(_TARGET.module)
        source = _capacity_ranking_source(inspect.unwrap(_TARGET.raw()))
        if source is None:
            return Probe(False, "topkgating has no per-expert capacity ranking (torch.topk(..., dim=0)) to check")
        if source == "logits":
            return Probe(True, "topkgating ranks each expert's tokens for the capacity cut with "
                         "torch.topk(topk_masked_gates, k=capacity, dim=0) on the top-k logits, not probabilities")
        return Probe(False, "topkgating ranks each expert's tokens for the capacity cut on the softmax probabilities")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_ranked_by_probabilities)]


def _capacity_ranking_source(function: Any) -> str | None:
    """What the capacity cut of ``function`` (``torch.topk(X, ..., dim=0)``) ranks: ``"logits"`` when ``X``
    comes from the function's first parameter without a softmax, ``"softmax"`` when it comes from a softmax,
    None when there is no such cut (or it cannot be followed). ``X`` is followed back through plain
    assignments, ``torch.topk(A, ...)`` (to ``A``) and ``zeros_like(...).scatter(dim, index, B)`` (to ``B``)."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    if not isinstance(definition, ast.FunctionDef) or not definition.args.args:
        return None
    logits = definition.args.args[0].arg
    assigned: dict[str, ast.expr] = {}
    for node in ast.walk(definition):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                for name in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(name, ast.Name):
                        assigned.setdefault(name.id, node.value)

    def called(node: ast.expr, name: str) -> bool:
        return (isinstance(node, ast.Call) and isinstance(node.func, (ast.Attribute, ast.Name)) and
                (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == name)

    def origin(node: ast.expr, depth: int = 0) -> str | None:
        if depth > 10:
            return None
        if isinstance(node, ast.Name):
            if node.id == logits:
                return "logits"
            return origin(assigned[node.id], depth + 1) if node.id in assigned else None
        if called(node, "softmax"):
            return "softmax"
        if called(node, "topk") and node.args:
            return origin(node.args[0], depth + 1)
        if called(node, "scatter") and len(node.args) == 3:
            return origin(node.args[2], depth + 1)
        return None

    cuts = [node for node in ast.walk(definition) if called(node, "topk") and node.args and any(
        keyword.arg == "dim" and isinstance(keyword.value, ast.Constant) and keyword.value.value == 0
        for keyword in node.keywords)]
    return origin(cuts[0].args[0]) if cuts else None


def _ranked_by_probabilities(original: Any) -> Any:
    module = import_target_module(_TARGET.module)

    @functools.wraps(original)
    def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
        if not drop_tokens or drop_policy != "probs":
            return original(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)
        import torch
        import torch.nn.functional as F

        # Upstream PR #7986's topkgating, drop_tokens=True and drop_policy='probs' path.
        gates = F.softmax(logits, dim=1)
        num_experts = int(gates.shape[1])
        top_gate, top_idx = torch.topk(gates, k=k, dim=1)  # was: torch.topk(logits, ...)
        mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
        exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
        me = torch.mean(gates, dim=0)
        ce = torch.mean(mask.float(), dim=0)
        l_aux = torch.mean(me * ce) * num_experts * num_experts / k
        capacity = module._capacity(gates, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
        # Rank each expert's tokens by their top-k gate probabilities (was: their top-k logits).
        topk_masked_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
        _, capacity_indices = torch.topk(topk_masked_gates, k=capacity, dim=0, sorted=False)
        capacity_mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(0, capacity_indices, True)
        mask &= capacity_mask
        locations = torch.cumsum(mask, dim=0) - 1
        # From here on the original's code, unchanged.
        gates_masked = gates * mask
        gates_s = torch.sum(gates_masked, dim=-1, keepdim=True)
        denom_s = torch.clamp(gates_s, min=torch.finfo(gates_masked.dtype).eps)
        gates_masked = gates_masked / denom_s
        locations_sc = module._one_hot_to_float((locations * mask), capacity)
        combine_weights = torch.einsum("se,sec->sec", gates_masked, locations_sc)
        dispatch_mask = combine_weights.bool()
        return l_aux, combine_weights, dispatch_mask, exp_counts

    return topkgating


FIX = MoeTopkGatingCapacityByLogits()
