"""Fix for zero1-fp32-grad-accum-not-reduced: replaces ``DeepSpeedZeroOptimizer.get_gradient_for_reduction``.

Under ZeRO stage 1 with a gradient accumulation dtype other than the model's (what the code calls "Stage 1,
Mode 2": ``use_grad_accum_attribute``), each parameter's gradient is accumulated in ``param.grad_accum`` (fp32).
The reduction takes its gradient from ``get_gradient_for_reduction``, which returns
``param.grad_accum.to(self.dtype)``: a new low-precision tensor. The IPG bucket copies that tensor, the
all-reduce averages the copy, and the reduced values are pointed back (``grad_reduc.data = ...``) into the copy
only. Every reader of the gradient afterwards (``copy_grads_in_partition``, the CPU-offload copies into the fp32
partition, ``get_all_grad_tensors`` / ``get_flat_partition``) reads ``param.grad_accum``, which still holds the
rank's own, unreduced gradient.

The replacement is upstream 0.19.8's method: it returns ``param.grad_accum`` itself, so the bucket copy, the
all-reduce and the ``.data`` re-pointing act on the accumulator the partition is read from (the copy into the
bucket casts the fp32 sum to the bucket's dtype, the dtype the gradients are communicated in by default, so
the result is plain data parallelism with fp32 accumulation and low-precision communication). Upstream 0.19.8
also keeps the reduced values in an fp32 partition buffer; this fix does not port that part, which changes
only the rounding of the reduced gradient, not whether it is reduced. The method is looked up on every call,
so the fix can be applied before or after ``deepspeed.initialize``.

On releases where ZeRO-1/2's flat buffer keeps an autograd graph (entry ``zero12-flat-buffer-detach``) two CPU
ranks fail at the first step before any gradient is reduced, so this fix requires that one (a no-op where its
bug is absent).
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_CLASS = "DeepSpeedZeroOptimizer"
_TARGET = Target(_MODULE, f"{_CLASS}.get_gradient_for_reduction")
# How the affected releases hand the accumulator to the reduction: a cast, i.e. a new tensor.
_COPY = "param.grad_accum.to(self.dtype)"
# What every later reader of the gradient reads in "Stage 1, Mode 2".
_READER = "param.grad_accum if self.use_grad_accum_attribute"


class Zero1Fp32GradAccumNotReduced(Fix):
    targets = (_TARGET,)
    requires = ("zero12-flat-buffer-detach",)

    def read_code(self) -> Probe:
        optimizer = getattr(import_target_module(_MODULE), _CLASS)
        method = getattr(optimizer, "get_gradient_for_reduction", None)
        if method is None:
            return Probe(False, f"{_CLASS} has no get_gradient_for_reduction (no separate gradient accumulation "
                                "dtype at ZeRO-1)")
        if _COPY not in inspect.getsource(method):
            return Probe(False, "get_gradient_for_reduction hands the reduction param.grad_accum itself, so the "
                                "all-reduce writes into the accumulator the partition is read from")
        reader = getattr(optimizer, "get_param_gradient_attribute", None)
        if reader is None or _READER not in inspect.getsource(reader):
            return Probe(False, "the partition is not read from param.grad_accum after the reduction")
        return Probe(True, f"get_gradient_for_reduction returns {_COPY}, a copy: the all-reduce averages the "
                           "copy, and the partition is read from param.grad_accum, the rank's unreduced gradient")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.replace(_reduce_the_accumulator())]


def _reduce_the_accumulator() -> Any:
    def get_gradient_for_reduction(self, param):
        # Upstream 0.19.8's method: in "Stage 1, Mode 2" the reduction gets param.grad_accum itself (not a
        # .to(self.dtype) copy), so the all-reduce's result lands where the partition is read from.
        if self.use_grad_accum_attribute:
            return param.grad_accum
        return param.grad

    return get_gradient_for_reduction


FIX = Zero1Fp32GradAccumNotReduced()
