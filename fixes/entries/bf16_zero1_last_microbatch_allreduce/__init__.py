"""Fix for bf16-zero1-last-microbatch-allreduce: replaces ``DeepSpeedEngine._backward_epilogue``.

The replacement is the affected releases' epilogue line for line, in upstream PR #7985's order: where the
optimizer is a BF16_Optimizer, its ``backward_epilogue()`` (which adds the micro-batch's bf16 gradients to
the fp32 ones) runs *before* ``allreduce_gradients()``, so the boundary micro-batch is in what is
all-reduced; every other ZeRO optimizer's ``backward_epilogue()`` stays after it. It cannot be a wrapper:
the original calls ``backward_epilogue()`` itself, after the all-reduce. Because the whole method is
replaced, the drift check makes sure the installed epilogue is, token for token, the one this copy was made
from. The probe reads the order of the two calls in the installed epilogue, and that
``BF16_Optimizer.backward_epilogue`` is where the fp32 accumulation happens.

Where ``bf16-gets-fp16-optimizer``'s bug is installed, the engine never builds BF16_Optimizer for this
configuration; applying this fix applies that one first (``requires``), so the configuration gets
BF16_Optimizer *and* its all-reduce in the right order.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_ENGINE = "deepspeed.runtime.engine"
_BF16 = "deepspeed.runtime.bf16_optimizer"
_METHOD = "_backward_epilogue"
_ALLREDUCE = "self.allreduce_gradients()"
_EPILOGUE = "self.optimizer.backward_epilogue()"


class Bf16Zero1LastMicrobatchAllreduce(Fix):
    targets = (Target(_ENGINE, f"DeepSpeedEngine.{_METHOD}"),)
    requires = ("bf16-gets-fp16-optimizer",)

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE)
        method = getattr(engine.DeepSpeedEngine, _METHOD, None)
        if method is None:
            return Probe(False, f"the engine has no {_METHOD} (engine.backward all-reduces after "
                                "BF16_Optimizer.backward has added the bf16 gradients to the fp32 ones)")
        source = inspect.getsource(method)
        if _EPILOGUE not in source:
            return Probe(False, f"{_METHOD} does not call the optimizer's backward_epilogue (BF16_Optimizer.backward "
                                "adds the bf16 gradients to the fp32 ones before the all-reduce)")
        bf16_epilogue = getattr(import_target_module(_BF16).BF16_Optimizer, "backward_epilogue", None)
        if bf16_epilogue is None or "update_hp_grads" not in inspect.getsource(bf16_epilogue):
            return Probe(False, "BF16_Optimizer.backward_epilogue does not add the bf16 gradients to the fp32 ones")
        if _ALLREDUCE in source and source.index(_ALLREDUCE) < source.index(_EPILOGUE):
            return Probe(True, f"{_METHOD} calls allreduce_gradients() before the optimizer's backward_epilogue(), "
                               "where BF16_Optimizer adds the micro-batch's gradients to the fp32 ones")
        return Probe(False, f"{_METHOD} runs the optimizer's backward_epilogue() before allreduce_gradients()")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].replace(_reordered_epilogue())]


def _reordered_epilogue() -> Any:
    engine = import_target_module(_ENGINE)  # the module's own names, as the original uses them
    ZeROOptimizer, see_memory_usage = engine.ZeROOptimizer, engine.see_memory_usage
    BF16_Optimizer = import_target_module(_BF16).BF16_Optimizer

    def _backward_epilogue(self):
        # DeepSpeed 0.18.3-0.18.9's method, line for line, in upstream PR #7985's order.
        self._stop_timers(self.engine_timers.backward_inner_timers)
        self._start_timers(self.engine_timers.backward_reduce_timers)
        # the fix: BF16_Optimizer adds this micro-batch's bf16 gradients to the fp32 ones *before* the
        # all-reduce, so the boundary micro-batch is reduced with the others
        bf16_optimizer = isinstance(self.optimizer, BF16_Optimizer)
        if bf16_optimizer:
            self.optimizer.backward_epilogue()

        if self.enable_backward_allreduce and not self.inside_no_sync_ctxt:
            # Traditional code path that allreduces the module parameter grads
            self.allreduce_gradients()

        if isinstance(self.optimizer, ZeROOptimizer):
            if not bf16_optimizer:
                self.optimizer.backward_epilogue()
            self.optimizer.exit_backward()

        see_memory_usage("Engine after backward", force=self.memory_breakdown())
        self._stop_timers(self.engine_timers.backward_reduce_timers)
        self._stop_timers(self.engine_timers.backward_timers)

    return _backward_epilogue


FIX = Bf16Zero1LastMicrobatchAllreduce()
