"""Fix for onecycle-stair-counts-ignored: replaces ``deepspeed.runtime.lr_schedules.OneCycle._get_scale_factor``
and wraps ``OneCycle._initialize_cycle``.

``_get_scale_factor`` is what both ``_get_cycle_lr`` and ``_get_cycle_mom`` scale the cycle's amplitude by (0 at
``cycle_min_lr`` / ``cycle_max_mom``, 1 at ``cycle_max_lr`` / ``cycle_min_mom``). The replacement computes the
continuous factor as the original does and, where the half cycle the batch is in has a stair count above 0,
quantises it into that many stairs from the integer batch offset inside the cycle, which is upstream PR #8179's
change: ``floor(offset * stair_count / half_length) / stair_count``, the offset counted from the cycle's start in
the first half and back from its end in the second. A stair count of 0 (the default) leaves the continuous factor
untouched, bit for bit.

The exact half lengths are needed for that floor (the float ``step_ratio * total_size`` can land a hair under a
stair boundary). ``_initialize_cycle`` does not keep them on affected releases, so the wrapper records them as
``first_step_size`` / ``second_step_size`` (the attributes upstream added). A scheduler built before the fix was
applied lacks them: the replacement then recovers them from ``total_size`` and ``step_ratio``, rounding to the
nearest whole number of batches where they are within 1e-9 of one (step sizes are batch counts).

The probe reads the ``OneCycle`` class's source: affected when ``_initialize_cycle`` stores ``first_stair_count``
and no method of the class reads it (or ``second_stair_count``) back.
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

_MODULE = "deepspeed.runtime.lr_schedules"
_SCALE = Target(_MODULE, "OneCycle._get_scale_factor")
_INIT_CYCLE = Target(_MODULE, "OneCycle._initialize_cycle")
_STAIRS = ("first_stair_count", "second_stair_count")


class OnecycleStairCountsIgnored(Fix):
    targets = (_SCALE, _INIT_CYCLE)

    def read_code(self) -> Probe:
        owner, _ = _SCALE.owner_and_name()
        tree = ast.parse(textwrap.dedent(inspect.getsource(owner)))
        stored = {node.attr for node in ast.walk(tree)
                  if isinstance(node, ast.Attribute) and node.attr in _STAIRS and isinstance(node.ctx, ast.Store)}
        read = sorted({node.attr for node in ast.walk(tree)
                       if isinstance(node, ast.Attribute) and node.attr in _STAIRS and isinstance(node.ctx, ast.Load)})
        if "first_stair_count" not in stored:
            return Probe(False, "OneCycle does not store the stair counts as self.first_stair_count")
        if read:
            return Probe(False, f"OneCycle reads self.{' and self.'.join(read)}: the stair counts shape the schedule")
        return Probe(True, "OneCycle._initialize_cycle stores self.first_stair_count and self.second_stair_count, "
                     "and no method of OneCycle reads them: _get_scale_factor is continuous")

    def patches(self) -> list[AttributePatch]:
        return [_INIT_CYCLE.wrap(_keep_half_lengths), _SCALE.wrap(_staircase_scale_factor)]


def _keep_half_lengths(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _initialize_cycle(self, *args, **kwargs):
        original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        first = float(bound["cycle_first_step_size"])
        second = bound["cycle_second_step_size"]
        self.first_step_size = first
        self.second_step_size = first if second is None else float(second)

    return _initialize_cycle


def _whole(value: float) -> float:
    nearest = round(value)
    return float(nearest) if abs(value - nearest) < 1e-9 else value


def _half_lengths(scheduler: Any) -> tuple[float, float]:
    first = getattr(scheduler, "first_step_size", None)
    second = getattr(scheduler, "second_step_size", None)
    if first is None or second is None:  # built before the fix was applied: recover them
        first = _whole(scheduler.step_ratio * scheduler.total_size)
        second = _whole(scheduler.total_size - first)
    return first, second


def _staircase_scale_factor(original: Any) -> Any:
    @functools.wraps(original)
    def _get_scale_factor(self):
        scale_factor = original(self)  # the continuous factor, as the installed code computes it
        batch_iteration = self.last_batch_iteration + 1
        cycle = math.floor(1 + batch_iteration / self.total_size)
        x = 1. + batch_iteration / self.total_size - cycle
        stair_count = self.first_stair_count if x <= self.step_ratio else self.second_stair_count
        if stair_count is not None and stair_count > 0:  # upstream PR #8179: hold the factor flat across each of stair_count steps
            first, second = _half_lengths(self)
            cycle_iteration = batch_iteration % self.total_size
            if cycle_iteration <= first:
                stair_position = cycle_iteration * stair_count / first
            else:
                stair_position = (self.total_size - cycle_iteration) * stair_count / second
            scale_factor = math.floor(stair_position) / stair_count
        return scale_factor

    return _get_scale_factor


FIX = OnecycleStairCountsIgnored()
