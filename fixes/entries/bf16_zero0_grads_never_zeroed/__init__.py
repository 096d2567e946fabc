"""Fix for bf16-zero0-grads-never-zeroed: does what upstream PR #7839 does, by wrapping two engine methods.

* ``DeepSpeedEngine._take_model_step``: after the original, an engine with bf16, no ZeRO and an fp16
  optimizer (``FP16_UnfusedOptimizer`` / ``FP16_Optimizer``: the DDP_BFLOAT16 path) calls
  ``self.optimizer.zero_grad()``, which the original's bf16 branch skips without ZeRO (it was written for
  BF16_Optimizer, which clears its own gradients). Nothing after ``optimizer.step()`` in the original reads
  the gradients, so clearing them at the end is what clearing them right after the step does. Only where
  the installed method has that gate.
* ``DeepSpeedEngine._configure_fp16_optimizer``: where ``FP16_UnfusedOptimizer`` takes no low-precision
  dtype (it always applies the config's fp16 loss scale, 65536 dynamic by default), an unfused optimizer
  built for ``torch.bfloat16`` gets ``cur_scale = 1.0`` and ``dynamic_loss_scale = False`` right after it
  is built: bf16 needs no loss scale (what PR #7839's ``LossScaleConfig`` gives bf16). Its ``backward``
  then scales by 1 and its ``step`` divides by 1, whether or not ``engine.backward`` calls it.
  ``FP16_Optimizer`` already uses a scale of 1 for bf16 and is left alone.

An engine built before ``apply()`` keeps its loss scale (the zero_grad part applies to it). Any other
engine (ZeRO, fp16, fp32, BF16_Optimizer) goes straight to the originals. The probe reads the gate in
``_take_model_step``, ``FP16_UnfusedOptimizer.__init__`` and the DDP_BFLOAT16 wrapper.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_ENGINE = "deepspeed.runtime.engine"
_UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer"
_FUSED = "deepspeed.runtime.fp16.fused_optimizer"
# The bf16 branch of _take_model_step up to PR #7839: zero_grad only under ZeRO, else `pass`.
_GATE = 'if self.zero_optimization() and hasattr(self.optimizer, "zero_grad"):'
# What an FP16_UnfusedOptimizer.__init__ that knows bf16 reads (PR #7839's LossScaleConfig).
_KNOWS_BF16 = ("low_precision_dtype", "loss_scale_config", "use_grad_scaling")

_STEP = Target(_ENGINE, "DeepSpeedEngine._take_model_step")
_CONFIGURE = Target(_ENGINE, "DeepSpeedEngine._configure_fp16_optimizer")
_UNFUSED_INIT = Target(_UNFUSED, "FP16_UnfusedOptimizer.__init__")


class Bf16Zero0GradsNeverZeroed(Fix):
    targets = (_STEP, _CONFIGURE, _UNFUSED_INIT)

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE)
        if getattr(engine, "DDP_BFLOAT16", None) is None:
            return Probe(False, "the engine has no DDP_BFLOAT16 wrapper: bf16 without ZeRO gets BF16_Optimizer, "
                                "which clears its own gradients and uses no loss scale")
        gated, scaled = _zero_grad_gated(), _unfused_scales_bf16()
        if not gated and not scaled:
            return Probe(False, "_take_model_step clears bf16 gradients without ZeRO too, and "
                                "FP16_UnfusedOptimizer gives bf16 no loss scale")
        found = [text for text, present in (
            ("_take_model_step clears bf16 gradients only under ZeRO", gated),
            ("FP16_UnfusedOptimizer applies the fp16 loss scale to bf16", scaled)) if present]
        return Probe(True, "; ".join(found) + ", and bf16 without ZeRO gets the fp16 optimizers (DDP_BFLOAT16)")

    def patches(self) -> list[AttributePatch]:
        import torch

        fp16_optimizers = (import_target_module(_UNFUSED).FP16_UnfusedOptimizer,
                           import_target_module(_FUSED).FP16_Optimizer)
        patches = []
        if _zero_grad_gated():
            patches.append(_STEP.wrap(lambda original: _clearing_step(original, fp16_optimizers)))
        if _unfused_scales_bf16():
            patches.append(_CONFIGURE.wrap(lambda original: _unscaled_bf16(original, fp16_optimizers[0], torch.bfloat16)))
        return patches


def _zero_grad_gated() -> bool:
    """``_take_model_step``'s bf16 branch calls zero_grad only under ZeRO."""
    source = _STEP.source()
    bf16_branch = source[source.find("if self.bfloat16_enabled():"):]
    return "if self.bfloat16_enabled():" in source and _GATE in bf16_branch.split("elif", 1)[0]


def _unfused_scales_bf16() -> bool:
    """``FP16_UnfusedOptimizer.__init__`` knows no low-precision dtype: its loss scale applies to bf16 too."""
    source = _UNFUSED_INIT.source()
    return "cur_scale" in source and not any(word in source for word in _KNOWS_BF16)


def _clearing_step(original: Any, fp16_optimizers: tuple[type, ...]) -> Any:
    @functools.wraps(original)
    def _take_model_step(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if (self.bfloat16_enabled() and not self.zero_optimization()
                and isinstance(self.optimizer, fp16_optimizers)):
            self.optimizer.zero_grad()  # what the fp16 branch (and PR #7839's bf16 branch) does after step()
        return result

    return _take_model_step


def _unscaled_bf16(original: Any, unfused: type, bfloat16: Any) -> Any:
    @functools.wraps(original)
    def _configure_fp16_optimizer(self, *args, **kwargs):
        optimizer = original(self, *args, **kwargs)
        dtype = inspect.signature(original).bind(self, *args, **kwargs).arguments.get("low_precision_dtype")
        if dtype == bfloat16 and type(optimizer) is unfused:
            optimizer.cur_scale = 1.0  # bf16 needs no loss scale: backward multiplies by 1, step divides by 1
            optimizer.dynamic_loss_scale = False
        return optimizer

    return _configure_fp16_optimizer


FIX = Bf16Zero0GradsNeverZeroed()
