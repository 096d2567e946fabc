"""Fix for warmup-cosine-lr-param-groups: wraps ``deepspeed.runtime.lr_schedules.WarmupCosineLR.get_lr``.

Before the scheduler's first ``step()`` (``last_batch_iteration < 0``) the original returns ``[0.0]``, one value,
and ``update_lr`` zips it with the parameter groups: only the first group is set to 0, the others keep their full
base LR. The wrapper calls the original (its "before it has started" warning included) and, in that case,
returns one 0.0 per group, which is upstream PR #7969's change (``[0.0 for _ in self.org_lrs]``). From the first
``step()`` on, the original's result is returned as it is. ``WarmupCosineLR.__init__`` calls ``self.get_lr()``,
so the class attribute is what it reaches.

``get_lr_ratio`` also returns ``[0.0]`` before the first step on affected releases (upstream changed it to 0.0 in
the same PR); ``get_lr`` never reaches that branch, so the fix leaves it alone.

The probe reads ``get_lr``'s source: affected when it returns a one-element list literal and ``__init__`` calls it.
Releases whose ``__init__`` never calls ``get_lr`` (0.15.2 and older) set no group's LR before the first step: every
group takes that step at its base LR, the warm-up's start skipped alike for all of them. That is not this bug (no
group differs from another) and this fix would not change it: those releases are not affected.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.lr_schedules", "WarmupCosineLR.get_lr")
_INIT = Target("deepspeed.runtime.lr_schedules", "WarmupCosineLR.__init__")  # read by the probe, never patched


class WarmupCosineLrParamGroups(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        calls = [node for node in ast.walk(ast.parse(textwrap.dedent(_INIT.source())))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get_lr"]
        if not calls:  # 0.15.2 and older: no group is set before the first step, so no group differs
            return Probe(False, "WarmupCosineLR.__init__ never calls get_lr: no group's LR is set before the first "
                         "step (every group starts at its base LR), so its one-element list is never applied")
        get_lr = inspect.unwrap(_TARGET.raw())
        tree = ast.parse(textwrap.dedent(inspect.getsource(get_lr)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.List) and len(node.value.elts) == 1:
                return Probe(True, f"WarmupCosineLR.get_lr returns {ast.unparse(node.value)} before the first "
                             "step: one LR, so update_lr sets only the first parameter group")
        return Probe(False, "WarmupCosineLR.get_lr returns no one-element list: every group gets its LR")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_one_lr_per_group)]


def _one_lr_per_group(original: Any) -> Any:
    @functools.wraps(original)
    def get_lr(self):
        lrs = original(self)
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]  # upstream PR #7969: 0 for every group, not only the first
        return lrs

    return get_lr


FIX = WarmupCosineLrParamGroups()
