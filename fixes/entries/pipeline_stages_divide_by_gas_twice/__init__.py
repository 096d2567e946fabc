"""Fix for pipeline-stages-divide-by-gas-twice: gives ``deepspeed.runtime.pipe.engine.PipelineEngine`` upstream
PR #8154's ``_backward_prologue_per_tensor``.

``DeepSpeedEngine.forward`` (from PR #7665) registers backward hooks on the module's outputs with
``preprocess_per_tensor_fn=self._backward_prologue_per_tensor``; the bound method is looked up on the engine
at every forward, so a method defined on ``PipelineEngine`` takes its place for pipeline engines only. The
added method calls the inherited ``_backward_prologue_per_tensor`` (``super()``, as upstream: the 1/gas
scaling) on the last stage,
whose loss gradient is the first one scaled, and returns the gradient unchanged on every stage before it,
which receives the already scaled gradient from the stage after it. Other engines are untouched.

The probe reads the installed code: ``DeepSpeedEngine.forward`` hands ``self._backward_prologue_per_tensor``
to ``register_output_backward_hooks``, ``DeepSpeedEngine._backward_prologue_per_tensor`` divides by
``gradient_accumulation_steps()``, and ``PipelineEngine`` defines no ``_backward_prologue_per_tensor`` of its
own. The one target, ``DeepSpeedEngine._backward_prologue_per_tensor``, is the code the last stage still runs.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module, undecorated

_ENGINE = "deepspeed.runtime.engine"
_PIPE = "deepspeed.runtime.pipe.engine"
_METHOD = "_backward_prologue_per_tensor"
_TARGET = Target(_ENGINE, f"DeepSpeedEngine.{_METHOD}")
_HOOKED = f"preprocess_per_tensor_fn=self.{_METHOD}"


class PipelineStagesDivideByGasTwice(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE).DeepSpeedEngine
        pipe = import_target_module(_PIPE).PipelineEngine
        forward = inspect.getsource(undecorated(engine.forward))
        if "register_output_backward_hooks" not in forward:
            return Probe(False, "DeepSpeedEngine.forward registers no output backward hooks (before PR #7665)")
        if _HOOKED not in forward:
            return Probe(False, f"DeepSpeedEngine.forward's output hooks do not run self.{_METHOD}")
        if "gradient_accumulation_steps()" not in inspect.getsource(undecorated(getattr(engine, _METHOD))):
            return Probe(False, f"DeepSpeedEngine.{_METHOD} does not scale by gradient_accumulation_steps")
        if _METHOD in vars(pipe):
            return Probe(False, f"PipelineEngine defines its own {_METHOD} (PR #8154)")
        return Probe(True, f"DeepSpeedEngine.forward's output hooks run DeepSpeedEngine.{_METHOD}, which divides "
                           f"every stage's output gradient by gradient_accumulation_steps, and PipelineEngine does "
                           "not override it")

    def patches(self) -> list[AttributePatch]:
        pipe = import_target_module(_PIPE).PipelineEngine
        return [AttributePatch(pipe, _METHOD, _last_stage_only(pipe))]


def _last_stage_only(pipe: Any) -> Any:
    def _backward_prologue_per_tensor(self, grad):
        # PR #8154: the last stage applies the 1/gas scaling before sending gradients upstream;
        # the stages before it receive an already scaled gradient and must not scale it again.
        if self.is_last_stage():
            return super(pipe, self)._backward_prologue_per_tensor(grad)  # upstream's super() call
        return grad

    return _backward_prologue_per_tensor


FIX = PipelineStagesDivideByGasTwice()
