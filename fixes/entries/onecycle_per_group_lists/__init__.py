"""Fix for onecycle-per-group-lists: wraps ``deepspeed.runtime.lr_schedules.OneCycle._initialize_lr`` and
``OneCycle._initialize_momentum``.

Each wrapper first turns its two bounds into one value per parameter group, as upstream PR #8201 does with the
module's ``_format_param``: a scalar is broadcast, a list or tuple must have one value per group (else
``ValueError: expected N value for cycle_min_lr, got M``, raised before the optimizer is touched). When neither
bound is a list the installed method runs unchanged, bit for bit. Otherwise the installed method runs with the
first group's values (so it sets up the decay flags, the no-betas warning and the LR type exactly as it does),
and the wrapper then stores the per-group lists (``min_lrs``/``max_lrs``, ``min_moms``/``max_moms`` with the
installed method's own beta2) and, on a fresh schedule (``last_batch_iteration == -1``), writes each group its
own starting LR (through the module's ``update_lr``, which keeps a tensor LR a tensor; before it existed, 0.15.2 and
older, as the installed method writes it) and betas.
``_get_cycle_lr``, ``_get_cycle_mom``, the decay and ``step()`` already work per group on affected releases, so
nothing else is patched. The fix touches other methods than onecycle-stair-counts-ignored's
(``_initialize_cycle``, ``_get_scale_factor``): the two compose in either order.

The probe reads the two methods' source: affected when ``self.min_lrs`` (or ``self.min_moms``) is built by
repeating one value (``[x] * len(optimizer.param_groups)``) rather than from a per-group list.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.runtime.lr_schedules"
_INIT_LR = Target(_MODULE, "OneCycle._initialize_lr")
_INIT_MOM = Target(_MODULE, "OneCycle._initialize_momentum")


class OnecyclePerGroupLists(Fix):
    targets = (_INIT_LR, _INIT_MOM)

    def read_code(self) -> Probe:
        repeated = []
        for target, attribute in ((_INIT_LR, "min_lrs"), (_INIT_MOM, "min_moms")):
            tree = ast.parse(textwrap.dedent(target.source()))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and t.attr == attribute
                                                         for t in node.targets)
                        and isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Mult)
                        and isinstance(node.value.left, ast.List)):
                    repeated.append(f"{target.qualname} builds self.{attribute} as [value] * len(param_groups)")
        if repeated:
            return Probe(True, "; ".join(repeated) + ": a per-group list is repeated whole into every group")
        return Probe(False, "OneCycle builds min_lrs and min_moms one value per parameter group")

    def patches(self) -> list[AttributePatch]:
        return [_INIT_LR.wrap(_per_group_lrs), _INIT_MOM.wrap(_per_group_momenta)]


def _per_group(optimizer: Any, value: Any, name: str) -> list[Any]:
    """Upstream's ``_format_param``: a scalar for every group, or a list/tuple checked to hold one per group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"expected {groups} value for {name}, got {len(value)}")
        return list(value)
    return [value] * groups


def _write_lrs(module: Any, param_groups: list, lrs: list[Any]) -> None:
    """Each group its own LR, as the installed release writes one: through the module's ``update_lr`` where it has
    one (it keeps a tensor LR a tensor), else as the installed ``_initialize_lr`` does, ``group['lr'] = lr``
    (releases before ``update_lr``: 0.15.2 and older)."""
    if hasattr(module, "update_lr"):
        module.update_lr(param_groups, lrs)
        return
    for lr, group in zip(lrs, param_groups):
        group["lr"] = lr


def _per_group_lrs(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _initialize_lr(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments
        optimizer = given["optimizer"]
        if not isinstance(given["cycle_min_lr"], (list, tuple)) and not isinstance(given["cycle_max_lr"], (list, tuple)):
            return original(self, *args, **kwargs)  # scalars: the installed code, untouched
        min_lrs = _per_group(optimizer, given["cycle_min_lr"], "cycle_min_lr")
        max_lrs = _per_group(optimizer, given["cycle_max_lr"], "cycle_max_lr")  # both checked before any write
        given["cycle_min_lr"], given["cycle_max_lr"] = min_lrs[0], max_lrs[0]
        result = original(*bound.args, **bound.kwargs)
        self.min_lrs, self.max_lrs = min_lrs, max_lrs
        if given["last_batch_iteration"] == -1:
            _write_lrs(inspect.getmodule(original), optimizer.param_groups, min_lrs)
        return result

    return _initialize_lr


def _per_group_momenta(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _initialize_momentum(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        given = bound.arguments
        optimizer = given["optimizer"]
        if not isinstance(given["cycle_min_mom"], (list, tuple)) and not isinstance(given["cycle_max_mom"], (list, tuple)):
            return original(self, *args, **kwargs)
        if "betas" not in optimizer.defaults:  # the installed code turns cycling off (and says so)
            return original(self, *args, **kwargs)
        min_moms = _per_group(optimizer, given["cycle_min_mom"], "cycle_min_mom")
        max_moms = _per_group(optimizer, given["cycle_max_mom"], "cycle_max_mom")
        given["cycle_min_mom"], given["cycle_max_mom"] = min_moms[0], max_moms[0]
        result = original(*bound.args, **bound.kwargs)
        beta2 = self.min_moms[0][1]  # the installed code's second beta (0.99)
        self.min_moms = [(mom, beta2) for mom in min_moms]
        self.max_moms = [(mom, beta2) for mom in max_moms]
        if given["last_batch_iteration"] == -1:
            for momentum, group in zip(self.min_moms, optimizer.param_groups):
                group["betas"] = momentum
        return result

    return _initialize_momentum


FIX = OnecyclePerGroupLists()
