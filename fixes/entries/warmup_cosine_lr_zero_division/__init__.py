"""Fix for warmup-cosine-lr-zero-division: wraps ``deepspeed.runtime.lr_schedules.WarmupCosineLR.get_lr_ratio``.

Before and during the warm-up (``last_batch_iteration < warmup_num_steps``) the wrapper returns the original's
ratio as it is (its "before it has started" warning and the warm-up formula included). From the first iteration
after the warm-up on it computes the cosine part as upstream PR #8142 does: the decay window is
``max(1, total_num_steps - warmup_num_steps)`` and the cosine progress is clamped to at most 1, so with
``total_num_steps <= warmup_num_steps`` every step after the warm-up runs at ``cos_min_ratio`` (no
ZeroDivisionError), and past ``total_num_steps`` the ratio stays at ``cos_min_ratio`` instead of rising again, as
the fixed releases do. Inside the decay window (``total_num_steps > warmup_num_steps``, progress at most 1) the
value is the original formula's, unchanged.

It patches a different attribute of the same class than warmup-cosine-lr-param-groups (``get_lr``, which calls
``self.get_lr_ratio()``), so the two compose in either order and revert independently.

The probe reads ``get_lr_ratio``'s source: affected when the cosine denominator
``total_num_steps - warmup_num_steps`` is not floored with ``max(...)``.
"""
from __future__ import annotations

import ast
import functools
import inspect
import math
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.lr_schedules", "WarmupCosineLR.get_lr_ratio")


class WarmupCosineLrZeroDivision(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        get_lr_ratio = inspect.unwrap(_TARGET.raw())
        tree = ast.parse(textwrap.dedent(inspect.getsource(get_lr_ratio)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "real_total_steps"
                                                    for t in node.targets):
                if isinstance(node.value, ast.BinOp) and isinstance(node.value.op, ast.Sub):
                    return Probe(True, f"WarmupCosineLR.get_lr_ratio divides by real_total_steps = "
                                 f"{ast.unparse(node.value)}, unguarded: 0 when total_num_steps equals "
                                 "warmup_num_steps")
                return Probe(False, f"WarmupCosineLR.get_lr_ratio guards its cosine denominator: "
                             f"real_total_steps = {ast.unparse(node.value)}")
        return Probe(False, "WarmupCosineLR.get_lr_ratio has no real_total_steps denominator to guard")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_guarded_cosine)]


def _guarded_cosine(original: Any) -> Any:
    @functools.wraps(original)
    def get_lr_ratio(self):
        if self.last_batch_iteration < self.warmup_num_steps:  # before the first step and the warm-up: original
            return original(self)
        real_last_step = self.last_batch_iteration - self.warmup_num_steps + 1
        real_total_steps = max(1, self.total_num_steps - self.warmup_num_steps)  # upstream PR #8142
        cosine_progress = min(1.0, real_last_step / real_total_steps)  # at cos_min_ratio from the end on
        ratio_delta = 1. - self.cos_min_ratio
        ratio = (1 + math.cos(math.pi * cosine_progress)) / 2
        return max(0.0, self.cos_min_ratio + ratio_delta * ratio)

    return get_lr_ratio


FIX = WarmupCosineLrZeroDivision()
