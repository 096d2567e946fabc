"""Fix for fp16-unfused-grad-norm-scaled: wraps ``FP16_UnfusedOptimizer.step``.

After the original step, where it took the step (no overflow, a finite norm), the wrapper divides the norm the step
stored (``_global_grad_norm``, of the fp16 gradients that still carry the loss scale) by the loss scale the step
unscaled the gradients with (``cur_scale``, read after the step as ``unscale_and_clip_grads`` reads it), as
``FP16_Optimizer.step`` does. The clipping inside the step is untouched: it was given the scaled norm and divides
it itself. ``engine.get_global_grad_norm()`` reads the optimizer's value after ``step()``
(``DeepSpeedEngine._take_model_step``), so it then reports the gradient's own norm. An overflowed step keeps its
``inf``. ``step_fused_lamb`` (the legacy LAMB path) is reached through ``step`` and is covered too.

On releases where ``engine.backward`` no longer lets this optimizer scale the loss (entry fp16-zero0-loss-scale),
the gradients carry no loss scale and the stored norm happens to be the gradient's own; dividing it there would be
wrong. This fix therefore requires that entry's fix, which puts the loss scale back first (a no-op where that bug
is absent).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.fp16.unfused_optimizer"
_CLASS = "FP16_UnfusedOptimizer"
_TARGET = Target(_MODULE, f"{_CLASS}.step")
_STORED = "self._global_grad_norm = get_global_norm(norm_list=norm_groups)"  # the norm of the scaled gradients
_CLIPPED = "self.unscale_and_clip_grads(self._global_grad_norm"  # ... which the clipping divides by cur_scale


class Fp16UnfusedGradNormScaled(Fix):
    targets = (_TARGET,)
    requires = ("fp16-zero0-loss-scale",)

    def read_code(self) -> Probe:
        module = import_target_module(_MODULE)
        optimizer = getattr(module, _CLASS, None)
        if optimizer is None:
            return Probe(False, f"{_MODULE} has no {_CLASS}")
        source = inspect.getsource(optimizer)
        if _STORED not in source or _CLIPPED not in source:
            return Probe(False, f"{_CLASS} no longer stores the norm of the loss-scaled gradients as "
                                "_global_grad_norm")
        return Probe(True, f"{_CLASS}.step stores _global_grad_norm = get_global_norm(...) of the fp16 gradients, "
                           "which carry the loss scale, and never divides it by cur_scale (FP16_Optimizer does)")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_reporting_unscaled_norm)]


def loss_scale(optimizer: Any) -> float:
    """The scale ``unscale_and_clip_grads`` divides the gradients by: ``cur_scale`` (in ``loss_scale_config`` on the
    releases that keep it there)."""
    config = getattr(optimizer, "loss_scale_config", None)
    return float(config.cur_scale if config is not None else optimizer.cur_scale)


def _reporting_unscaled_norm(original: Any) -> Any:
    @functools.wraps(original)
    def step(self, *args, **kwargs):
        overflow = original(self, *args, **kwargs)
        if not overflow:  # an overflowed step stored inf (_skip_invalid_grad_norm): nothing to unscale
            self._global_grad_norm = self._global_grad_norm / loss_scale(self)
        return overflow

    return step


FIX = Fp16UnfusedGradNormScaled()
