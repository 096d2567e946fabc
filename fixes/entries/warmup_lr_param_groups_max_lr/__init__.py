"""Fix for warmup-lr-param-groups-max-lr: wraps ``deepspeed.runtime.lr_schedules.WarmupLR.__init__``.

When the caller leaves ``warmup_max_lr`` out (or passes ``None``), the wrapper passes the list of every
parameter group's own LR instead, which is upstream PR #8171's change (``[group['lr'] for group in
param_groups]`` without the ``[0]``). Everything else is the original ``__init__``. ``WarmupDecayLR`` inherits
the method and calls it through ``super()``, so an explicit ``warmup_max_lr=None`` there is fixed too (its own default is
0.001, not the optimizer's LR). An explicit ``warmup_max_lr`` (a number or a list) is passed through untouched.

The probe reads ``WarmupLR.__init__``'s source: affected when the default for an omitted ``warmup_max_lr`` is
the first element (``[0]``) of the list of the groups' LRs.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.lr_schedules", "WarmupLR.__init__")


class WarmupLrParamGroupsMaxLr(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        init = inspect.unwrap(_TARGET.raw())
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "warmup_max_lr"
                                                     for t in node.targets)):
                value = node.value
                if isinstance(value, ast.Subscript) and isinstance(value.value, (ast.ListComp, ast.List)):
                    return Probe(True, "WarmupLR.__init__ sets an omitted warmup_max_lr to "
                                 f"{ast.unparse(value)}: the first group's LR, for every group")
                return Probe(False, f"WarmupLR.__init__ sets an omitted warmup_max_lr to {ast.unparse(value)}")
        return Probe(False, "WarmupLR.__init__ does not derive warmup_max_lr from the optimizer's groups")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_each_group_its_own_lr)]


def _each_group_its_own_lr(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        if bound.arguments.get("warmup_max_lr") is None:
            from deepspeed.runtime.lr_schedules import get_torch_optimizer

            groups = get_torch_optimizer(bound.arguments["optimizer"]).param_groups
            bound.arguments["warmup_max_lr"] = [group["lr"] for group in groups]  # upstream PR #8171
        original(*bound.args, **bound.kwargs)

    return __init__


FIX = WarmupLrParamGroupsMaxLr()
