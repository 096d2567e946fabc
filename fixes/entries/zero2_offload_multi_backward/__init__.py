"""Fix for zero2-offload-multi-backward: wraps ``DeepSpeedZeroOptimizer.copy_grads_in_partition``.

With CPU offload and ``gradient_accumulation_steps == 1`` the wrapper first adds the partition gradient
to the CPU running sum (``async_accumulate_grad_in_cpu_via_gpu``) whenever another backward came
before it in this step (``micro_step_id > 0``) or follows it (not at the accumulation boundary), then
calls the original, whose boundary copy then takes the sum; the same order as upstream PR #7981.
The probe looks for the ``if self.gradient_accumulation_steps > 1`` gate in front of that call.
The running sum is only right from the third backward on once ``zero2-offload-grad-accum`` is
fixed too, so this fix requires it.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_CLASS = "DeepSpeedZeroOptimizer"
_METHOD = "copy_grads_in_partition"
_GAS_GATE = re.compile(r"if self\.gradient_accumulation_steps > 1:\s*self\.async_accumulate_grad_in_cpu_via_gpu")


class Zero2OffloadMultiBackward(Fix):
    targets = (Target(_MODULE, f"{_CLASS}.{_METHOD}"),)
    requires = ("zero2-offload-grad-accum",)

    def read_code(self) -> Probe:
        method = getattr(getattr(import_target_module(_MODULE), _CLASS), _METHOD)
        if _GAS_GATE.search(inspect.getsource(method)):
            return Probe(True, f"{_METHOD} keeps a CPU running sum only when gradient_accumulation_steps > 1")
        return Probe(False, f"{_METHOD} accumulates whenever another backward came before or follows")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].wrap(_accumulating)]


def _accumulating(original: Any) -> Any:
    @functools.wraps(original)
    def copy_grads_in_partition(self, param):
        # The original accumulates only when gas > 1; with gas = 1 a running sum is needed exactly
        # when this is not the step's only backward. Same order as upstream: accumulate, then the
        # original's boundary copy.
        if (self.cpu_offload and self.gradient_accumulation_steps == 1
                and (self.micro_step_id > 0 or not self.is_gradient_accumulation_boundary)):
            self.async_accumulate_grad_in_cpu_via_gpu(param)
        return original(self, param)

    return copy_grads_in_partition


FIX = Zero2OffloadMultiBackward()
