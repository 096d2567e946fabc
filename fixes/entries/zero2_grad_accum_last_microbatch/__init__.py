"""Fix for zero2-grad-accum-last-microbatch: replaces ``DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue``.

The replacement is the affected releases' epilogue line for line, except the test that decides
between starting and adding to the running sum: it tests ``all_grad_tensors[i]``, the dict the sum
is kept in, instead of ``averaged_gradients[i]`` (set only at the boundary), as upstream PR #7665
does. Because the whole method is replaced, the drift check makes sure the installed epilogue is,
token for token, the one this copy was made from. The probe looks for the ``averaged_gradients[i]
is None`` test in front of the assignment to ``all_grad_tensors[i]``.
"""
from __future__ import annotations

import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_CLASS = "DeepSpeedZeroOptimizer"
_METHOD = "independent_gradient_partition_epilogue"
_WRONG_TEST = re.compile(r"averaged_gradients\[i\] is None:\s*self\.all_grad_tensors\[i\] =")


class Zero2GradAccumLastMicrobatch(Fix):
    targets = (Target(_MODULE, f"{_CLASS}.{_METHOD}"),)

    def read_code(self) -> Probe:
        method = getattr(getattr(import_target_module(_MODULE), _CLASS), _METHOD)
        if _WRONG_TEST.search(inspect.getsource(method)):
            return Probe(True, f"{_METHOD} tests averaged_gradients but accumulates into all_grad_tensors")
        return Probe(False, f"{_METHOD} tests the dict it accumulates into")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].replace(_corrected_epilogue())]


def _corrected_epilogue() -> Any:
    stage = import_target_module(_MODULE)  # the module's own helpers, as the original uses them
    get_accelerator, see_memory_usage = stage.get_accelerator, stage.see_memory_usage

    def independent_gradient_partition_epilogue(self):
        # DeepSpeed 0.17.6/0.18.2's method, line for line, except the marked test.
        self.report_ipg_memory_usage("In ipg_epilogue before reduce_ipg_grads", 0)
        self.reduce_ipg_grads()
        self.report_ipg_memory_usage("In ipg_epilogue after reduce_ipg_grads", 0)

        for i in range(len(self.params_already_reduced)):
            self.params_already_reduced[i] = False

        if self.overlap_comm:
            if not get_accelerator().resolves_data_dependency():
                get_accelerator().synchronize()
            # It is safe to clear previously reduced grads of other partitions
            self._clear_previous_reduced_grads()

        if self.cpu_offload is False:
            for i, _ in enumerate(self.bit16_groups):
                if i not in self.all_grad_tensors or self.all_grad_tensors[i] is None:  # the fix
                    self.all_grad_tensors[i] = self.get_all_grad_tensors(self.params_in_partition[i],
                                                                         dtype=self.gradient_accumulation_dtype)
                else:
                    avg_new = self.get_all_grad_tensors(self.params_in_partition[i],
                                                        dtype=self.gradient_accumulation_dtype)
                    for accumulated_grad, new_avg_grad in zip(self.all_grad_tensors[i], avg_new):
                        accumulated_grad.add_(new_avg_grad)
                if self.is_gradient_accumulation_boundary:
                    self.averaged_gradients[i] = self.get_flat_partition(
                        self.params_in_partition[i],
                        self.first_offset[i],
                        self.partition_size[i],
                        dtype=self.gradient_accumulation_dtype,
                        device=get_accelerator().current_device_name(),
                        param_group_idx=i,
                        return_tensor_list=True)
                    self.all_grad_tensors[i] = None

        self._release_ipg_buffers()

        # No need to keep the gradients anymore.
        # All gradients required by the step
        # are in self.averaged_gradients
        self.zero_grad(set_to_none=True)
        see_memory_usage("End ipg_epilogue")

    return independent_gradient_partition_epilogue


FIX = Zero2GradAccumLastMicrobatch()
