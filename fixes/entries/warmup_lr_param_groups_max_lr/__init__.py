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

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.lr_schedules", "WarmupLR.__init__")


class WarmupLrParamGroupsMaxLr(Fix):
    info = FixInfo(
        id="warmup-lr-param-groups-max-lr",
        title="WarmupLR warms every parameter group up to the first group's LR",
        summary=("With the WarmupLR scheduler and no warmup_max_lr in its params, every "
                 "parameter group warms up to the learning rate of the first group instead of to its own: a "
                 "head or layer given a 10x learning rate trains at the first group's rate, and a group with a "
                 "smaller rate trains too fast. There is no error or warning; engine.get_lr() shows the same "
                 "value for every group."),
        symptom="silent wrong result",
        components=("LR schedulers",),
        error_signatures=(
            "WarmupLR all param groups same learning rate",
            "WarmupLR ignores per-parameter-group lr when warmup_max_lr is not set",
            "engine.get_lr() returns the same lr for every param group",
        ),
        root_cause=("deepspeed/runtime/lr_schedules.py, WarmupLR.__init__: when warmup_max_lr is None it takes "
                    "warmup_max_lr = [group['lr'] for group in self.optimizer.param_groups][0], a single number "
                    "(the first group's LR), and _format_param repeats a number for every group, so max_lrs "
                    "(and delta_lrs) are the first group's for all of them."),
        reproduce_release="0.18.9",
        upstream_fixed_in="0.19.4",
        upstream_introduced="0.17.2",
        upstream_prs=(8171, 7360),
        upstream_note=("PR #7360 made an omitted warmup_max_lr default to the optimizer's LR (before it, the "
                       "default was 0.001 for every group); PR #8171 takes each group's own LR."),
    )
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
