"""Fix for zero2-offload-grad-accum: wraps ``DeepSpeedZeroOptimizer.async_accumulate_grad_in_cpu_via_gpu``.

The original keeps each parameter's running gradient sum in a CPU buffer
(``accumulated_grads_in_cpu``) but stores it there only on micro-step 0. The wrapper runs the
original and then, on every later micro-step, copies the sum it just formed (the parameter's
gradient attribute) back into that buffer: the whole flat gradient, or the parameter's slice of it
(``grad_position``) where master weights and gradients are low precision. The same as upstream
PR #7967. The probe looks for ``copy_gradients_to_cpu()`` in the ``else`` branch of
``if self.micro_step_id > 0``.
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
_METHOD = "async_accumulate_grad_in_cpu_via_gpu"
# The sum is only copied back to the CPU buffer when nothing was accumulated: the bug.
_COPY_ONLY_ON_FIRST = re.compile(r"if self\.micro_step_id > 0:\s*accumulate_gradients\(\)\s*else:\s*"
                                 r"copy_gradients_to_cpu\(\)")


class Zero2OffloadGradAccum(Fix):
    targets = (Target(_MODULE, f"{_CLASS}.{_METHOD}"),)

    def read_code(self) -> Probe:
        method = getattr(getattr(import_target_module(_MODULE), _CLASS), _METHOD)
        if _COPY_ONLY_ON_FIRST.search(inspect.getsource(method)):
            return Probe(True, f"{_METHOD} copies the sum back to CPU only on micro-step 0")
        return Probe(False, f"{_METHOD} stores the running sum on every micro-step")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].wrap(_storing_sum)]


def _storing_sum(original: Any) -> Any:
    @functools.wraps(original)
    def async_accumulate_grad_in_cpu_via_gpu(self, param):
        original(self, param)
        if self.micro_step_id > 0:
            # The original added the CPU buffer into the gradient; store that sum back, as its own
            # copy_gradients_to_cpu() does on micro-step 0.
            param_id = self.get_param_id(param)
            grad_accum = self.get_param_gradient_attribute(param)
            # Renamed from fp16_master_weights_and_gradients in 0.18.3/0.18.4.
            low_precision = getattr(self, "low_precision_master_weights_and_grads",
                                    getattr(self, "fp16_master_weights_and_gradients", False))
            if not low_precision:
                self.accumulated_grads_in_cpu[param_id].data.copy_(grad_accum.data.view(-1), non_blocking=True)
            else:
                _, source_offset, _, num_elements = self.grad_position[param_id]
                self.accumulated_grads_in_cpu[param_id].data.copy_(
                    grad_accum.data.view(-1).narrow(0, source_offset, num_elements), non_blocking=True)

    return async_accumulate_grad_in_cpu_via_gpu


FIX = Zero2OffloadGradAccum()
