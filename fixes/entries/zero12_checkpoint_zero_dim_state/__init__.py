"""Fix for zero12-checkpoint-zero-dim-state: wraps
``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer._get_state_without_padding``.

With ``zero_optimization.elastic_checkpoint`` on, ``DeepSpeedZeroOptimizer.state_dict`` writes each parameter
group's optimizer state through ``_get_base_optimizer_state``, which cuts the alignment padding off every tensor in
the state with ``_get_state_without_padding``: ``value[:value.numel() - padding]``. A torch optimizer keeps its step
count as a 0-dim tensor (``state["step"]``), and a 0-dim tensor cannot be sliced.

The wrapper hands the original the state without its 0-dim tensors, then puts those back unchanged, in the state's
own key order: what upstream PR #7659 does (``torch.is_tensor(value) and value.dim() > 0``), with the original's
slicing kept for every tensor that has a dimension. A state without 0-dim tensors goes to the original as it is.

The probe reads ``_get_state_without_padding``'s source: affected when it slices (``value[:...]``) and reads no
tensor's ``dim()`` / ``ndim`` / ``shape`` first.
"""
from __future__ import annotations

import ast
import functools
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.zero.stage_1_and_2", "DeepSpeedZeroOptimizer._get_state_without_padding")
_SHAPE_READS = ("dim", "ndim", "ndimension", "shape")


class Zero12CheckpointZeroDimState(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        function = ast.parse(textwrap.dedent(_TARGET.source())).body[0]
        slices = any(isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Slice)
                     for node in ast.walk(function))
        if not slices:
            return Probe(False, "_get_state_without_padding slices no tensor")
        reads = sorted({node.attr for node in ast.walk(function)
                        if isinstance(node, ast.Attribute) and node.attr in _SHAPE_READS})
        if reads:
            return Probe(False, f"_get_state_without_padding reads value.{reads[0]} before slicing: 0-dim "
                                "tensors are kept as they are")
        return Probe(True, "_get_state_without_padding slices every tensor of the optimizer state "
                           "(value[:lean_length]) without looking at its dimensions: a 0-dim step count cannot be sliced")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_keeping_zero_dim_tensors)]


def _is_zero_dim_tensor(value: Any) -> bool:
    import torch

    return torch.is_tensor(value) and value.dim() == 0


def _keeping_zero_dim_tensors(original: Any) -> Any:
    @functools.wraps(original)
    def _get_state_without_padding(self, state_with_padding, padding):
        scalars = {key: value for key, value in state_with_padding.items() if _is_zero_dim_tensor(value)}
        if not scalars:
            return original(self, state_with_padding, padding)
        # upstream PR #7659: a 0-dim tensor (a torch optimizer's step count) has no padding to cut
        lean = original(self, {k: v for k, v in state_with_padding.items() if k not in scalars}, padding)
        return {key: scalars[key] if key in scalars else lean[key] for key in state_with_padding}

    return _get_state_without_padding


FIX = Zero12CheckpointZeroDimState()
