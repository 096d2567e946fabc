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

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target, import_target_module, undecorated

_ENGINE = "deepspeed.runtime.engine"
_PIPE = "deepspeed.runtime.pipe.engine"
_METHOD = "_backward_prologue_per_tensor"
_TARGET = Target(_ENGINE, f"DeepSpeedEngine.{_METHOD}")
_HOOKED = f"preprocess_per_tensor_fn=self.{_METHOD}"


class PipelineStagesDivideByGasTwice(Fix):
    info = FixInfo(
        id="pipeline-stages-divide-by-gas-twice",
        title="Pipeline engine: the stages before the last divide their gradients by gradient_accumulation_steps twice",
        summary=("With PipelineEngine.train_batch and gradient_accumulation_steps > 1, the last stage's update "
                 "matches plain PyTorch but every earlier stage's is divided by gradient_accumulation_steps once "
                 "more for each stage after it (with 2 stages and gas 4: a quarter of plain PyTorch's). "
                 "DeepSpeedEngine.forward's output backward hooks divide each output gradient by "
                 "gradient_accumulation_steps on every stage, though the gradient an earlier stage receives from "
                 "the next one is already divided. Nothing is raised; the loss is right; the earlier stages "
                 "train too slowly, and gradient norms and clipping see too small gradients. Shown with ZeRO-0 and "
                 "ZeRO-1, fp32 and bf16 (ZeRO-0 fp32 only where pipeline-nested-backward's refusal does not stop "
                 "it first)."),
        symptom="silent wrong result",
        components=("pipeline", "engine"),
        error_signatures=(
            "pipeline parallel first stage gradients divided by gradient_accumulation_steps twice",
            "pipeline earlier stages gradient scaled by 1/gas^2",
            "PipelineEngine first stage grad norm smaller with gradient accumulation",
            "_backward_prologue_per_tensor divides received gradient by gradient_accumulation_steps",
            'gradient accumulation scaling applied at every pipeline stage boundary instead of once',
        ),
        root_cause=("deepspeed/runtime/engine.py, DeepSpeedEngine.forward registers output backward hooks "
                    "(register_output_backward_hooks, preprocess_per_tensor_fn=self._backward_prologue_per_tensor) "
                    "and DeepSpeedEngine._backward_prologue_per_tensor divides each output gradient by "
                    "gradient_accumulation_steps; deepspeed/runtime/pipe/engine.py, PipelineEngine "
                    "(_exec_backward_pass: torch.autograd.backward(outputs, received_grads) on the stages before "
                    "the last) does not override it, so the gradient the last stage already divided is divided "
                    "again on every earlier stage."),
        reproduce_release="0.18.9",
        upstream_introduced="0.18.3",  # PR #7665's first release
        upstream_fixed_in="0.19.3",  # PR #8154's first release
        upstream_issues=(8152,),
        upstream_prs=(7665, 8154),
        upstream_note=("Introduced by PR #7665 (0.18.3: the 1/gas scaling moved into output backward hooks); issue "
                       "#8152, fixed by PR #8154 (0.19.3), whose PipelineEngine._backward_prologue_per_tensor this "
                       "fix installs. On the releases where pipeline-nested-backward's refusal stops ZeRO-0 "
                       "pipelines, that entry's fix applies this one too."),
        related=("pipeline-grad-accum-sums", "pipeline-nested-backward"),  # same symptom; same cause (PR #7665)
    )
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
