"""Fix for zero12-cpu-no-allreduce-noncontiguous: replaces ``stage_1_and_2.split_half_float_double``.

With ``contiguous_gradients: false`` ZeRO-1/2 reduce a bucket of gradients through
``reduce_ipg_grads`` -> ``buffered_reduce_fallback``, which all-reduces only what
``split_half_float_double`` puts into per-dtype buckets. That function picks tensors by their legacy
type string, built from the accelerator's device name (``"torch.cpu.FloatTensor"`` on the CPU
accelerator), but a CPU tensor's ``type()`` is ``"torch.FloatTensor"``: nothing matches and nothing is
all-reduced. On CUDA the strings match (``"torch.cuda.FloatTensor"``), so the probe reports the bug
only where the accelerator is the CPU one, and the fix is then a no-op elsewhere.

The replacement is upstream PR #8382's function (0.19.8): the same buckets in the same order (half,
float, double, bfloat16), chosen by ``tensor.dtype`` and only for strided (dense) tensors, as the
type strings also excluded sparse ones. The module-level function is looked up on every reduction,
so the fix can be applied at any time. The probe looks for the type strings built from
``device_name()`` in the installed function, and for the CPU accelerator.

On releases where ZeRO-1/2's flat buffer keeps an autograd graph (entry
``zero12-flat-buffer-detach``) two ranks fail at the first step before any gradient is reduced, so
this fix requires that one (a no-op where its bug is absent).
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_FUNCTION = "split_half_float_double"
# How the affected releases name the buckets: legacy type strings with the accelerator's device name.
_TYPE_STRINGS = '"torch.{}.FloatTensor".format(device_type)'


class Zero12CpuNoAllreduceNoncontiguous(Fix):
    targets = (Target(_MODULE, _FUNCTION),)
    requires = ("zero12-flat-buffer-detach",)

    def read_code(self) -> Probe:
        function = getattr(import_target_module(_MODULE), _FUNCTION)
        if _TYPE_STRINGS not in inspect.getsource(function):
            return Probe(False, f"{_FUNCTION} does not pick gradients by type strings built from the device name")
        device_type = _device_name()
        if device_type != "cpu":
            return Probe(False, f"{_FUNCTION} picks gradients by \"torch.{device_type}.<dtype>Tensor\", which is "
                                f"what {device_type} tensors report (only CPU tensors lack the device prefix)")
        return Probe(True, f"{_FUNCTION} looks for \"torch.cpu.FloatTensor\" and the like, but CPU tensors report "
                           "\"torch.FloatTensor\": no gradient is all-reduced")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].replace(_split_by_dtype())]


def _device_name() -> str:
    """The name DeepSpeed builds the type strings from (``get_accelerator().device_name()``)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _split_by_dtype() -> Any:
    import torch

    def split_half_float_double(tensors):
        # Upstream PR #8382's function: the same buckets, in the same order, chosen by dtype (which does
        # not depend on the device) instead of legacy type strings; only dense tensors, as before.
        dtypes = [torch.half, torch.float, torch.double, torch.bfloat16]
        buckets = []
        for dtype in dtypes:
            bucket = [t for t in tensors if t.dtype == dtype and t.layout == torch.strided]
            if bucket:
                buckets.append(bucket)
        return buckets

    return split_half_float_double


FIX = Zero12CpuNoAllreduceNoncontiguous()
