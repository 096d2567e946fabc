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

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_CLASS = "DeepSpeedZeroOptimizer"
_TARGET = Target(_MODULE, f"{_CLASS}.get_gradient_for_reduction")
# How the affected releases hand the accumulator to the reduction: a cast, i.e. a new tensor.
_COPY = "param.grad_accum.to(self.dtype)"
# What every later reader of the gradient reads in "Stage 1, Mode 2".
_READER = "param.grad_accum if self.use_grad_accum_attribute"


class Zero1Fp32GradAccumNotReduced(Fix):
    info = FixInfo(
        id="zero1-fp32-grad-accum-not-reduced",
        title=("ZeRO-1 with fp32 gradient accumulation (fp16, or bf16 with CPU offload): gradients are never "
               "averaged across ranks"),
        summary=("With ZeRO stage 1, data_types.grad_accum_dtype fp32 and fp16 (with or without "
                 "offload_optimizer) or bf16 with offload_optimizer to CPU, on two or more data-parallel ranks, "
                 "the gradients are never averaged over the ranks: the all-reduce runs on a bf16/fp16 copy of the "
                 "fp32 accumulated gradient and its result is thrown away, so each rank updates the partition of "
                 "the weights it owns with its own local gradient only, as if its shard of the batch were the "
                 "whole batch. Every gradient_accumulation_steps is affected. Nothing is raised, the loss goes "
                 "down, the ranks stay in sync; the model just trains on a per-partition fraction of the data."),
        symptom="silent wrong result",
        components=("ZeRO-1/2", "offload", "fp16", "bf16"),
        error_signatures=(
            "ZeRO-1 grad_accum_dtype fp32 gradients are not all-reduced",
            "gradients not averaged across ranks with fp32 gradient accumulation",
            "bf16 ZeRO stage 1 offload_optimizer grad_accum_dtype fp32 multi-GPU results differ from single GPU",
            "fp16 ZeRO-1 fp32 grad accumulation each rank uses its local gradient",
            "loss is worse with more GPUs when data_types grad_accum_dtype is fp32",
            "get_gradient_for_reduction returns a copy of grad_accum",
            "param.grad_accum.to(self.dtype)",
            "Stage 1, Mode 2 reduction result discarded",
        ),
        root_cause=("deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.get_gradient_for_reduction: "
                    "with use_grad_accum_attribute (ZeRO-1 with a gradient accumulation dtype other than the "
                    "model's) it returns param.grad_accum.to(self.dtype), a new tensor. "
                    "reduce_independent_p_g_buckets_and_remove_grads copies that tensor into the IPG bucket, "
                    "average_tensor all-reduces the bucket, and only the copy is pointed at the reduced values; "
                    "copy_grads_in_partition, the CPU-offload copies (get_param_gradient_attribute) and "
                    "get_all_grad_tensors / get_flat_partition then read param.grad_accum, the rank's own "
                    "unreduced fp32 gradient. The engine builds this optimizer for fp16 + fp32 accumulation at "
                    "stage 1, and for bf16 + fp32 accumulation at stage 1 only with offload_optimizer "
                    "(otherwise BF16_Optimizer)."),
        reproduce_release="0.19.3",
        upstream_fixed_in="0.19.8",
        upstream_prs=(),
        upstream_note=("No upstream issue or PR names this bug as such. The copy came with PR #2847 ('ZeRO Gradient "
                       "Accumulation Dtype', 0.10.1), which introduced grad_accum_dtype for ZeRO; the configuration "
                       "(bf16, fp32 gradient accumulation, ZeRO-1, CPU offload) is the one of issue #4083, "
                       "reported there for crashes in this reduction path. "
                       "0.19.8's rework of stage_1_and_2.py fixes it: get_gradient_for_reduction returns "
                       "param.grad_accum itself, the IPG buckets of this mode hold the gradient accumulation dtype, "
                       "and the reduced gradient is kept in an fp32 partition buffer "
                       "(_use_compact_grad_partition_buffer); the PR that made that change was not located."),
        related=("bf16-zero1-last-microbatch-allreduce", "zero12-cpu-no-allreduce-noncontiguous"),
    )
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
