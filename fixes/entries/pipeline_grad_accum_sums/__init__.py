"""Fix for pipeline-grad-accum-sums: wraps ``deepspeed.runtime.engine.DeepSpeedEngine.backward``.

Since ``no_sync`` (PR #6675), the engine divides the loss by ``gradient_accumulation_steps`` only when
``do_gradient_reduction = self.enable_backward_allreduce and not self.inside_no_sync_ctxt`` (plus, from
0.17, ``not self.is_deepcompile_enabled()``/``is_deepcompile_active()``). ``PipelineEngine.__init__`` sets
``enable_backward_allreduce = False`` because it schedules its own all-reduce, so its last stage
(``super().backward(self.loss)``) never scales the loss and the micro-batches' gradients are summed, not
averaged: every stage's gradient is ``gradient_accumulation_steps`` times too large.

The condition sits in ``DeepSpeedEngine.backward`` (0.16.0 - 0.16.4) or in ``DeepSpeedEngine._backward_prologue``
(0.16.5 - 0.18.2), which ``backward`` calls. The wrapper, on a pipeline engine only, divides the loss by
``gradient_accumulation_steps`` (``self._scale_loss_by_gas``) before calling the original ``backward``
exactly when the original's own condition without its ``enable_backward_allreduce`` term holds (so the
original, whose term is False, does not scale it again). Other engines pass through untouched. The
earlier stages receive the already divided gradient from the last stage, so they are right too.

The probe reads the method that calls ``_scale_loss_by_gas``: affected when that call is conditioned on
``enable_backward_allreduce`` and ``PipelineEngine.__init__`` turns that flag off. From 0.18.3 (PR #7665)
neither ``backward`` nor ``_backward_prologue`` calls ``_scale_loss_by_gas`` (output hooks divide every
gradient by gas): the probe says so and the fix is a no-op there (see the entry pipeline-nested-backward).
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module, undecorated

_ENGINE = "deepspeed.runtime.engine"
_PIPE = "deepspeed.runtime.pipe.engine"
_TARGET = Target(_ENGINE, "DeepSpeedEngine.backward")
# The original's decision, as written in 0.16.0 - 0.18.2 (the deepcompile term from 0.17).
_CONDITION = re.compile(r"do_gradient_reduction = self\.enable_backward_allreduce and not self\.inside_no_sync_ctxt"
                        r"(?: and not self\.(?P<deepcompile>is_deepcompile_(?:enabled|active))\(\s*\))?\s*\n")
_SCALING = re.compile(r"if do_gradient_reduction and self\.gradient_accumulation_steps\(\) > 1 and scale_wrt_gas:\s*"
                      r"loss = self\._scale_loss_by_gas\(loss\.float\(\)\)")
# The condition of the `if` whose body scales the loss by 1/gas, in whichever release.
_SCALING_GUARD = re.compile(r"if (?P<condition>[^\n]*):\s*\n\s*loss = self\._scale_loss_by_gas\(")
_OVERRIDE = re.compile(r"if self\.scale_wrt_gas is not None:\s*scale_wrt_gas = self\.scale_wrt_gas")


class PipelineGradAccumSums(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE).DeepSpeedEngine
        pipe = import_target_module(_PIPE).PipelineEngine
        if "self.enable_backward_allreduce = False" not in inspect.getsource(pipe.__init__):
            return Probe(False, "PipelineEngine.__init__ does not turn enable_backward_allreduce off")
        method = _scaling_method(engine)
        if method is None:
            return Probe(False, "neither DeepSpeedEngine.backward nor _backward_prologue calls _scale_loss_by_gas "
                                "(the 1/gas scaling is elsewhere, e.g. output backward hooks, PR #7665)")
        guard = _SCALING_GUARD.search(_source(engine, method))
        if guard is None or not any(word in guard.group("condition")
                                    for word in ("do_gradient_reduction", "enable_backward_allreduce")):
            # 0.15.x and older: `if self.gradient_accumulation_steps() > 1 and scale_wrt_gas:` (the all-reduce
            # alone looks at enable_backward_allreduce)
            return Probe(False, f"DeepSpeedEngine.{method} scales the loss by 1/gas without looking at "
                                "enable_backward_allreduce")
        return Probe(True, f"DeepSpeedEngine.{method} scales the loss by 1/gas only if enable_backward_allreduce, "
                           "which PipelineEngine.__init__ sets to False")

    def patches(self) -> list[AttributePatch]:
        engine = import_target_module(_ENGINE).DeepSpeedEngine
        method = _scaling_method(engine)
        source = _source(engine, method) if method else ""
        condition, scaling, override = _CONDITION.search(source), _SCALING.search(source), _OVERRIDE.search(source)
        parameters = inspect.signature(undecorated(_TARGET.raw())).parameters
        if not (condition and scaling and override) or "scale_wrt_gas" not in parameters:
            raise DriftError(f"{_ENGINE}.DeepSpeedEngine.{method or 'backward'}: the 1/gas scaling is not "
                             "`do_gradient_reduction = self.enable_backward_allreduce and not self.inside_no_sync_ctxt"
                             "[ and not self.is_deepcompile_...()]` / `if do_gradient_reduction and "
                             "self.gradient_accumulation_steps() > 1 and scale_wrt_gas`, or backward() has no "
                             "scale_wrt_gas: not the code this fix was written for. Nothing was patched.")
        return [_TARGET.wrap(functools.partial(_average_micro_batches, deepcompile=condition.group("deepcompile")))]


def _source(engine: Any, method: str) -> str:
    return inspect.getsource(undecorated(getattr(engine, method)))


def _scaling_method(engine: Any) -> str | None:
    """The method of DeepSpeedEngine that calls _scale_loss_by_gas for backward (None: neither does)."""
    for method in ("_backward_prologue", "backward"):
        if hasattr(engine, method) and "self._scale_loss_by_gas(" in _source(engine, method):
            return method
    return None


def _average_micro_batches(original: Any, deepcompile: str | None) -> Any:
    signature = inspect.signature(undecorated(original))

    @functools.wraps(original)
    def backward(self, loss, *args, **kwargs):
        if getattr(self, "pipeline_parallelism", False) and not self.enable_backward_allreduce:
            bound = signature.bind(self, loss, *args, **kwargs)
            bound.apply_defaults()
            scale_wrt_gas = bound.arguments["scale_wrt_gas"]
            if self.scale_wrt_gas is not None:
                scale_wrt_gas = self.scale_wrt_gas
            # The original's condition without `self.enable_backward_allreduce`, which the pipeline engine
            # turns off only to run its own all-reduce: the original then does not scale a second time.
            reduction = not self.inside_no_sync_ctxt and not (deepcompile and getattr(self, deepcompile)())
            if reduction and self.gradient_accumulation_steps() > 1 and scale_wrt_gas:
                loss = self._scale_loss_by_gas(loss.float())
        return original(self, loss, *args, **kwargs)

    return backward


FIX = PipelineGradAccumSums()
