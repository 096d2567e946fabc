"""Fix for zero3-reload-states-wrong-order: the backport of upstream PR #7050, which maps the parameter
partitions back onto ZeRO-3's flat parameter buffer in the order the buffer was laid out in.

ZeRO-3 without parameter offload keeps every parameter's partition (``param.ds_tensor``) as a view of one flat
buffer, ``lp_param_buffer``, laid out in the optimizer's order: group by group, sub-group by sub-group
(``fp16_groups``, ``DeepSpeedZeroOptimizer_Stage3._create_fp16_partitions_with_defragmentation``).
``reload_states`` copies the buffer back to the device and re-points each partition at its slice, computing the
slices from ``self.module.parameters()``, the model's order. Where the optimizer's groups list the parameters in
another order (Hugging Face Trainer's weight-decay split: all weights, then all biases), a partition is pointed at
another parameter's values.

The fix wraps ``reload_states``: the installed code runs unchanged, then, where the low-precision parameters
were offloaded (``OffloadStateTypeEnum.lp_params`` in ``offloaded_states`` on entry), each partition is pointed
again at ``lp_param_buffer`` in ``fp16_groups`` order, as upstream's ``_get_parameter_partitions`` does. Only
views are re-pointed (no value is copied), and the installed code's own mapping in between re-points views too,
so nothing it did is lost. Where the groups keep the model's order both mappings are the same.

``offload_states`` computes its slices of the CPU copy the same way, on affected and fixed releases alike
(upstream changed ``reload_states`` only): while the states are offloaded a partition may show another
parameter's values; ``reload_states`` is what training continues from, and is what this fix corrects.

The probe reads ``reload_states`` for the mapping over ``self.module.parameters()``.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.runtime.zero.stage3"
_CLASS = "DeepSpeedZeroOptimizer_Stage3"
_RELOAD = Target(_MODULE, f"{_CLASS}.reload_states")
# reload_states' mapping of the partitions onto lp_param_buffer in the model's order (stage3.py, before PR #7050)
_MODEL_ORDER = re.compile(r"get_mapping_to_flat_buffer\(\s*\[\s*p\.ds_tensor\s+for\s+p\s+in\s+self\.module\.parameters\(\)\s*\]\s*\)")


class Zero3ReloadStatesWrongOrder(Fix):
    targets = (_RELOAD,)

    def read_code(self) -> Probe:
        owner, name = _RELOAD.owner_and_name()
        if name not in vars(owner):
            return Probe(False, f"{_CLASS} has no reload_states")
        source = inspect.getsource(_RELOAD.code())
        if _MODEL_ORDER.search(source):
            return Probe(True, "reload_states maps the partitions onto lp_param_buffer in self.module.parameters() "
                               "order; the buffer is laid out in fp16_groups order")
        return Probe(False, "reload_states does not map the partitions in self.module.parameters() order (upstream "
                            "PR #7050 maps them in fp16_groups order)")

    def patches(self) -> list[AttributePatch]:
        return [_RELOAD.wrap(_remapped_in_buffer_order)]


def _remapped_in_buffer_order(original: Any) -> Any:
    """``reload_states`` as installed, then the partitions re-pointed at ``lp_param_buffer`` in ``fp16_groups``
    order (where the low-precision parameters were offloaded)."""
    from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum
    from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

    @functools.wraps(original)
    def reload_states(self, *args, **kwargs):
        lp_params_offloaded = OffloadStateTypeEnum.lp_params in self.offloaded_states
        result = original(self, *args, **kwargs)
        if lp_params_offloaded:  # upstream PR #7050: the buffer's own order, _get_parameter_partitions
            partitions = [param.ds_tensor for sub_group in self.fp16_groups for param in sub_group]
            for tensor, offset, tensor_numel in get_mapping_to_flat_buffer(partitions):
                tensor.data = self.lp_param_buffer.narrow(0, offset, tensor_numel)
        return result

    return reload_states


FIX = Zero3ReloadStatesWrongOrder()
