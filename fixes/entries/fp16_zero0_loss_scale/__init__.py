"""Fix for fp16-zero0-loss-scale: wraps ``DeepSpeedEngine.backward``.

When the engine's optimizer is ``FP16_Optimizer`` or ``FP16_UnfusedOptimizer`` without ZeRO, the
wrapper registers a gradient hook on the caller's loss that multiplies the gradient entering the
graph by exactly the factor that optimizer's own ``backward()`` would have used (the
``loss_scale`` property: the custom scale if one was set, else the static or current dynamic
``cur_scale``; nothing when the optimizer does not scale), calls the original, and removes the
hook. The returned loss is untouched. The probe answers not affected where ``engine.backward``
still reaches ``optimizer.backward`` (through ``_do_optimizer_backward``) or handles the fp16 loss
scale itself, and where the fp16 optimizers' ``step()`` no longer unscales; nothing is patched
there, so the loss is never scaled twice.

Side effect: bf16 without ZeRO and without fp32 accumulation (the DDP_BFLOAT16 path, also
FP16_UnfusedOptimizer) keeps a loss scale on some releases and has the same gap there; the fix
applies that scale as ``_do_optimizer_backward`` did (one step then matches plain PyTorch). That
path's other fault, gradients not cleared between steps (issue #7837, PR #7839), is not fixed here.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, DecoratedTarget, import_target_module, undecorated

_MODULE = "deepspeed.runtime.engine"
_CLASS = "DeepSpeedEngine"
_METHOD = "backward"
_FP16_OPTIMIZERS = ("FP16_Optimizer", "FP16_UnfusedOptimizer")


class Fp16Zero0LossScale(Fix):
    targets = (DecoratedTarget(_MODULE, f"{_CLASS}.{_METHOD}"),)

    def read_code(self) -> Probe:
        engine = import_target_module(_MODULE)
        method = vars(getattr(engine, _CLASS))[_METHOD]
        source = inspect.getsource(undecorated(method))
        if "_do_optimizer_backward" in source:
            return Probe(False, "engine.backward calls _do_optimizer_backward, which lets the fp16 optimizer "
                                "scale the loss")
        if "fp16_enabled" in source or "cur_scale" in source or ".optimizer.backward(" in source:
            return Probe(False, "engine.backward handles the fp16 optimizers' loss scale")
        if not all(self._step_unscales(engine, name) for name in _FP16_OPTIMIZERS):
            return Probe(False, "the fp16 optimizers' step() no longer divides by the loss scale")
        return Probe(True, "engine.backward scales the loss only for ZeRO optimizers and autocast, while "
                           "FP16_Optimizer/FP16_UnfusedOptimizer.step() divide by cur_scale")

    @staticmethod
    def _step_unscales(engine: Any, name: str) -> bool:
        optimizer = getattr(engine, name, None)
        return optimizer is not None and "unscale_and_clip_grads" in inspect.getsource(optimizer.step)

    def patches(self) -> list[AttributePatch]:
        engine = import_target_module(_MODULE)
        fp16_optimizers = tuple(getattr(engine, name) for name in _FP16_OPTIMIZERS)
        return [self.targets[0].wrap(lambda original: _scaling_backward(original, fp16_optimizers))]


def fp16_loss_scale(engine: Any, fp16_optimizers: tuple[type, ...]) -> float | None:
    """The factor the engine's fp16 optimizer's own ``backward()`` multiplies the loss by, or None
    where no scaling is due (not an fp16 optimizer, ZeRO, or a scale of 1, e.g. bf16)."""
    optimizer = getattr(engine, "optimizer", None)
    if not isinstance(optimizer, fp16_optimizers) or engine.zero_optimization():
        return None
    scale = optimizer.loss_scale  # custom scale if set, else cur_scale; None when it does not scale
    return None if scale is None or float(scale) == 1.0 else float(scale)


def _scaling_backward(original: Any, fp16_optimizers: tuple[type, ...]) -> Any:
    def backward(self, loss, *args, **kwargs):
        scale = fp16_loss_scale(self, fp16_optimizers)
        if scale is None or not getattr(loss, "requires_grad", False):
            return original(self, loss, *args, **kwargs)
        # Multiply the gradient entering the graph, as (loss.float() * cur_scale).backward() did up to
        # 0.18.2; the loss engine.backward returns (and logs) stays unscaled.
        handle = loss.register_hook(lambda grad: grad * scale)
        try:
            return original(self, loss, *args, **kwargs)
        finally:
            handle.remove()

    backward.__doc__ = undecorated(original).__doc__
    backward.__qualname__ = f"{_CLASS}.{_METHOD}"
    return backward


FIX = Fp16Zero0LossScale()
