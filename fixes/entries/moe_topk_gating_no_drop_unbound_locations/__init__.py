"""Fix for moe-topk-gating-no-drop-unbound-locations: wraps ``deepspeed.moe.sharded_moe.topkgating``.

The wrapper handles the one path that has the bug, ``drop_tokens=False``, with upstream PR #7163's code: the
capacity is the largest number of tokens any expert got (all-reduced over ``ep_group`` and padded to the tensor
parallel size, as in the original), and ``locations = torch.cumsum(mask, dim=0) - 1`` is set in that branch, which
the original never does. Every call with ``drop_tokens=True`` goes to the release's own function unchanged. The
module's own ``groups``, ``dist``, ``bwc_tensor_model_parallel_world_size`` and ``_one_hot_to_float`` are looked
up at each call, as the original does. ``TopKGate.forward`` looks ``topkgating`` up in the module when it runs, so
patching the module attribute fixes every ``MoE`` / ``TopKGate`` layer, including those built before
``fixes.apply``.

The other fixes of ``topkgating`` (``moe-topk-gating-capacity-by-logits``, ``moe-capacity-exceeds-tokens``) handle
``drop_tokens=True`` calls only and pass ``drop_tokens=False`` to the function they wrap, and this one does the
reverse: on a release that has all three they compose in any order, each wrapper handing the others' calls down.

The probe reads ``topkgating``'s source: it finds the ``if drop_tokens:`` statement and is affected when its
``else`` branch (no dropping) assigns no ``locations`` while the lines after it read ``locations``.
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


class MoeTopkGatingNoDropUnboundLocations(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        import_target_module(_TARGET.module)
        answer = _no_drop_branch_sets_locations(inspect.unwrap(_TARGET.raw()))
        if answer is None:
            return Probe(False, "topkgating has no `if drop_tokens:` statement with an `else` branch, or does not "
                         "read locations after it")
        if answer:
            return Probe(False, "topkgating's drop_tokens=False branch sets locations")
        return Probe(True, "topkgating's drop_tokens=False branch (`else:` of `if drop_tokens:`) sets the capacity "
                     "but no locations, which _one_hot_to_float((locations * mask), capacity) reads after it")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_with_no_drop_locations)]


def _no_drop_branch_sets_locations(function: Any) -> bool | None:
    """Whether the ``else`` branch of ``function``'s ``if drop_tokens:`` assigns ``locations`` (a value other
    than None); None where there is no such statement or nothing after it reads ``locations``."""
    definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    if not isinstance(definition, ast.FunctionDef):
        return None
    body = definition.body
    for index, statement in enumerate(body):
        if (isinstance(statement, ast.If) and isinstance(statement.test, ast.Name)
                and statement.test.id == "drop_tokens" and statement.orelse):
            after = ast.Module(body=body[index + 1:], type_ignores=[])
            if not any(isinstance(node, ast.Name) and node.id == "locations" and isinstance(node.ctx, ast.Load)
                       for node in ast.walk(after)):
                return None
            return any(isinstance(node, ast.Assign) and not (isinstance(node.value, ast.Constant)
                                                             and node.value.value is None)
                       and any(isinstance(target, ast.Name) and target.id == "locations" for target in node.targets)
                       for branch in statement.orelse for node in ast.walk(branch))
    return None


def _with_no_drop_locations(original: Any) -> Any:
    module = import_target_module(_TARGET.module)

    @functools.wraps(original)
    def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
        if drop_tokens:
            return original(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)
        import torch
        import torch.nn.functional as F

        # Upstream PR #7163's topkgating, drop_tokens=False path: the original's code plus `locations`.
        _, top_idx = torch.topk(logits, k=k, dim=1)
        gates = F.softmax(logits, dim=1)
        num_experts = int(gates.shape[1])
        mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, 1)
        exp_counts = torch.sum(mask, dim=0).detach().to(logits.device)
        me = torch.mean(gates, dim=0)
        ce = torch.mean(mask.float(), dim=0)
        l_aux = torch.mean(me * ce) * num_experts * num_experts / k
        # Do not drop tokens: the capacity is the most tokens any expert got.
        new_capacity = torch.max(exp_counts)
        if ep_group is not None:
            module.dist.all_reduce(new_capacity, op=module.dist.ReduceOp.MAX, group=ep_group)
        if module.groups._get_expert_model_parallel_world_size() == 1:
            tp = 1 if module.groups.mpu is None else module.bwc_tensor_model_parallel_world_size(mpu=module.groups.mpu)
            new_capacity = torch.ceil(new_capacity / tp).mul(tp).to(new_capacity.dtype)
        capacity = new_capacity
        locations = torch.cumsum(mask, dim=0) - 1  # the line the original lacks (upstream PR #7163)
        gates_masked = gates * mask
        gates_s = torch.sum(gates_masked, dim=-1, keepdim=True)
        denom_s = torch.clamp(gates_s, min=torch.finfo(gates_masked.dtype).eps)
        gates_masked = gates_masked / denom_s
        locations_sc = module._one_hot_to_float((locations * mask), capacity)
        combine_weights = torch.einsum("se,sec->sec", gates_masked, locations_sc)
        dispatch_mask = combine_weights.bool()
        return l_aux, combine_weights, dispatch_mask, exp_counts

    return topkgating


FIX = MoeTopkGatingNoDropUnboundLocations()
