"""Fix for moe-capacity-exceeds-tokens: wraps ``deepspeed.moe.sharded_moe._top_idx`` and
``deepspeed.moe.sharded_moe.topkgating``.

Both drop branches cut each expert's tokens with ``torch.topk(..., k=capacity, dim=0)`` over the token dimension,
which cannot select more rows than there are tokens. Upstream PR #8155 bounds only the *selection* by the number of
tokens and keeps ``capacity`` as the width of the dispatch buffer (``combine_weights`` / ``dispatch_mask`` stay
``[tokens, experts, capacity]``, which a tensor-parallel ``drop_tokens()`` needs divisible by its size). The fix does
the same:

* ``top1gating`` selects with the module-level ``_top_idx(mask1_rand, capacity)``, looked up in the module at each
  call: the replacement ``_top_idx`` takes ``min(k, source.shape[0])`` rows, which is upstream's
  ``selection_capacity``. ``top1gating`` itself is not touched. (On affected releases ``_top_idx`` is scripted or
  compiled; the replacement is plain PyTorch, and computes the same indices.)
* ``topkgating``: where ``drop_tokens=True``, ``drop_policy='probs'`` and the capacity exceeds the number of tokens,
  the wrapper calls the original with ``drop_policy='position'``. With a capacity of at least the number of tokens,
  upstream's bounded ``probs`` branch selects every token for every expert (its capacity mask is all True) and sets
  ``locations = cumsum(mask) - 1``; the ``position`` branch computes the same ``locations`` and keeps every location
  below the capacity, which is all of them: the outputs are identical, bit for bit, and the capacity stays the
  buffer width. Every other call goes to the original unchanged. The capacity is the module's own ``_capacity``.

``moe-topk-gating-capacity-by-logits`` (a bug of older releases in the same ``probs`` branch) replaces that branch
with its own code, which selects ``capacity`` rows as well: applied on top of this fix it would bring the crash back.
So it is required: applied first, it sits under this wrapper, which hands it the ``position`` calls (its wrapper
passes those to the original).

The probe reads ``topkgating`` and ``top1gating``: affected when the ``torch.topk(..., dim=0)`` of the one or the
``_top_idx(...)`` call of the other is given ``capacity`` itself, unbounded.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module


@dataclass(frozen=True)
class _ScriptedTarget(Target):
    """A target that DeepSpeed wraps in ``torch.jit.script`` (older releases) or ``torch.compile`` (newer ones),
    fingerprinted by its Python source: a compiled function keeps it as ``__wrapped__``, a script function as
    ``_torchdynamo_inline``."""

    def code(self) -> Any:
        code = super().code()
        return getattr(code, "_torchdynamo_inline", code)


_MODULE = "deepspeed.moe.sharded_moe"
_TOPK = Target(_MODULE, "topkgating")
_TOP_IDX = _ScriptedTarget(_MODULE, "_top_idx")
_TOP1 = Target(_MODULE, "top1gating")  # read by the probe only: the caller of _top_idx


class MoeCapacityExceedsTokens(Fix):
    targets = (_TOPK, _TOP_IDX)
    requires = ("moe-topk-gating-capacity-by-logits",)

    def read_code(self) -> Probe:
        import_target_module(_MODULE)
        unbounded = [name for name, target, call in (("topkgating", _TOPK, _topk_dim0_k),
                                                      ("top1gating", _TOP1, _top1_selection_k))
                     if call(inspect.unwrap(target.raw())) == "capacity"]
        if unbounded:
            return Probe(True, f"{' and '.join(unbounded)} select{'s' if len(unbounded) == 1 else ''} each expert's "
                         "tokens with torch.topk(..., k=capacity, dim=0), capacity not bounded by the number of "
                         "tokens")
        return Probe(False, "topkgating and top1gating bound the torch.topk(..., dim=0) selection by the number of "
                     "tokens")

    def patches(self) -> list[AttributePatch]:
        return [_TOP_IDX.wrap(_bounded_top_idx), _TOPK.wrap(_capacity_above_tokens_keeps_every_token)]


def _function_tree(function: Any) -> ast.FunctionDef | None:
    definition = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    return definition if isinstance(definition, ast.FunctionDef) else None


def _calls(definition: ast.FunctionDef, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(definition) if isinstance(node, ast.Call) and
            (node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)) == name]


def _name(node: ast.expr | None) -> str | None:
    return node.id if isinstance(node, ast.Name) else None


def _topk_dim0_k(function: Any) -> str | None:
    """The name given as ``k`` to ``function``'s ``torch.topk(..., dim=0)`` (the capacity cut), or None."""
    definition = _function_tree(function)
    for call in _calls(definition, "topk") if definition else []:
        keywords = {keyword.arg: keyword.value for keyword in call.keywords}
        dim = keywords.get("dim")
        if isinstance(dim, ast.Constant) and dim.value == 0:
            return _name(keywords.get("k", call.args[1] if len(call.args) > 1 else None))
    return None


def _top1_selection_k(function: Any) -> str | None:
    """The name ``function`` (``top1gating``) passes as ``k`` to ``_top_idx`` (its second argument), or to a
    ``torch.topk(..., dim=0)`` of its own where it calls none; None if it selects neither way."""
    definition = _function_tree(function)
    for call in _calls(definition, "_top_idx") if definition else []:
        return _name(call.args[1] if len(call.args) > 1 else next(
            (keyword.value for keyword in call.keywords if keyword.arg == "k"), None))
    return _topk_dim0_k(function)


def _bounded_top_idx(original: Any) -> Any:
    @functools.wraps(original)
    def _top_idx(source, k):
        # upstream PR #8155's selection_capacity: at most as many rows as there are tokens (then every token)
        import torch

        return torch.topk(source, k=min(int(k), source.shape[0]), dim=0)[1]

    return _top_idx


def _capacity_above_tokens_keeps_every_token(original: Any) -> Any:
    module = import_target_module(_MODULE)

    @functools.wraps(original)
    def topkgating(logits, k, capacity_factor, min_capacity, drop_tokens=True, ep_group=None, drop_policy="probs"):
        if drop_tokens and drop_policy == "probs":
            import torch

            capacity = module._capacity(logits, torch.tensor(capacity_factor * k), torch.tensor(min_capacity))
            if int(capacity) > logits.shape[0]:
                # Every token fits: the 'probs' cut keeps all of them (upstream bounds its topk by the tokens), and so
                # does the 'position' cut, which computes the same locations with no torch.topk over the tokens.
                drop_policy = "position"
        return original(logits, k, capacity_factor, min_capacity, drop_tokens, ep_group, drop_policy)

    return topkgating


FIX = MoeCapacityExceedsTokens()
