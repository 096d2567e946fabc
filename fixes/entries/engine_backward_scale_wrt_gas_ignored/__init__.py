"""Fix for engine-backward-scale-wrt-gas-ignored: backports PR #7724 (``_backward_prologue_per_tensor`` divides
only when ``engine.backward`` was called with ``scale_wrt_gas=True``).

Two patches on ``deepspeed.runtime.engine.DeepSpeedEngine``:

* ``backward`` is wrapped to keep its ``scale_wrt_gas`` argument on the engine (attribute
  ``_fixbook_scale_wrt_gas``) while the original runs, and to put the previous value back afterwards (upstream
  leaves its ``_scale_wrt_gas`` at the last call's value; here a later direct ``loss.backward()`` is divided by
  gas as it is without the fix). Arguments, return value and everything else pass through unchanged.
* ``_backward_prologue_per_tensor`` (the hook ``DeepSpeedEngine.forward`` registers on every output, through
  ``register_output_backward_hooks(preprocess_per_tensor_fn=self._backward_prologue_per_tensor)``) is wrapped to
  return the gradient unchanged while that attribute is False, and otherwise to call the original (``grad /
  gradient_accumulation_steps()``). The bound method is looked up at every forward, so engines built before
  ``fixes.apply()`` pick it up at their next forward.

Both wrappers keep ``__wrapped__``, so other fixes' probes and drift checks read the installed code under them
(pipeline-stages-divide-by-gas-twice overrides ``_backward_prologue_per_tensor`` on ``PipelineEngine`` and calls
the inherited one through ``super()``, which is this wrapper; fp16-zero0-loss-scale wraps ``backward`` again).

Composing with fixes that wrap ``backward`` before this one: fp16-zero0-loss-scale's wrapper sets no
``__wrapped__``, so the drift check of ``backward`` here first steps under every Fixbook patch applied to that
attribute (the registry's applied fixes know what they replaced) and fingerprints DeepSpeed's own method; the
wrapper then wraps whatever is stored. ``fixes.revert()`` with no ids takes them off in the reverse order.

As upstream, only the ``scale_wrt_gas`` argument counts: the engine attribute ``scale_wrt_gas``, which
``_backward_prologue`` read before PR #7665, stays ignored.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, DecoratedTarget, Target, import_target_module, undecorated

_ENGINE = "deepspeed.runtime.engine"
_CLASS = "DeepSpeedEngine"
_PER_TENSOR = "_backward_prologue_per_tensor"
_STATE = "_fixbook_scale_wrt_gas"


class _UnderFixbookPatches(DecoratedTarget):
    """``DeepSpeedEngine.backward`` fingerprinted under every Fixbook patch applied to it (a wrapper without
    ``__wrapped__``, such as fp16-zero0-loss-scale's, would otherwise hide DeepSpeed's method), then under
    ``@instrument_w_nvtx``."""

    def code(self) -> Any:
        owner, name = self.owner_and_name()
        return undecorated(_under_fixbook_patches(owner, name, self.raw()))


def _under_fixbook_patches(owner: Any, name: str, stored: Any) -> Any:
    """What ``owner.name`` was before the Fixbook's applied fixes patched it (``stored`` where none did)."""
    from ...registry import all_fixes

    found = True
    while found:
        found = False
        for fix in all_fixes():
            for patch in fix._active:  # noqa: SLF001 - the framework's record of what each applied fix replaced
                if patch.owner is owner and patch.name == name and patch.new is stored:
                    stored, found = patch.original, True
    return stored


_BACKWARD = _UnderFixbookPatches(_ENGINE, f"{_CLASS}.backward")
_HOOK = Target(_ENGINE, f"{_CLASS}.{_PER_TENSOR}")


class EngineBackwardScaleWrtGasIgnored(Fix):
    targets = (_BACKWARD, _HOOK)

    def read_code(self) -> Probe:
        engine = getattr(import_target_module(_ENGINE), _CLASS)
        backward = undecorated(_under_fixbook_patches(engine, "backward", vars(engine)["backward"]))
        if "scale_wrt_gas" not in inspect.signature(backward).parameters:
            return Probe(False, "DeepSpeedEngine.backward takes no scale_wrt_gas argument")
        hook = vars(engine).get(_PER_TENSOR)
        if hook is None:
            return Probe(False, f"DeepSpeedEngine has no {_PER_TENSOR}: engine.backward scales the loss itself "
                                "(_backward_prologue), before PR #7665")
        source = inspect.getsource(inspect.unwrap(hook))
        if "gradient_accumulation_steps()" not in source:
            return Probe(False, f"DeepSpeedEngine.{_PER_TENSOR} does not divide by gradient_accumulation_steps")
        if "scale_wrt_gas" in source:
            return Probe(False, f"DeepSpeedEngine.{_PER_TENSOR} divides only when scale_wrt_gas is set (PR #7724)")
        if "is_current_graph_registered" in source:
            return Probe(False, f"DeepSpeedEngine.{_PER_TENSOR} leaves engine.backward's own graph alone, and "
                                "engine.backward divides the loss itself only when scale_wrt_gas is set")
        return Probe(True, f"DeepSpeedEngine.{_PER_TENSOR}, the hook on every output, divides each gradient by "
                           "gradient_accumulation_steps() whatever engine.backward's scale_wrt_gas says")

    def patches(self) -> list[AttributePatch]:
        return [_BACKWARD.wrap(_remembering_backward), _HOOK.wrap(_respecting_hook)]


def _remembering_backward(original: Any) -> Any:
    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        previous = self.__dict__.get(_STATE, True)
        self.__dict__[_STATE] = bool(scale_wrt_gas)
        try:
            return original(self, loss, retain_graph, scale_wrt_gas)
        finally:
            self.__dict__[_STATE] = previous

    backward.__doc__ = undecorated(original).__doc__
    backward.__qualname__ = f"{_CLASS}.backward"
    backward.__wrapped__ = original  # other entries' probes and drift checks read the code underneath
    return backward


def _respecting_hook(original: Any) -> Any:
    def _backward_prologue_per_tensor(self, grad):
        # PR #7724: scale by gradient accumulation steps only if engine.backward(..., scale_wrt_gas=True)
        if grad is not None and not self.__dict__.get(_STATE, True):
            return grad
        return original(self, grad)

    _backward_prologue_per_tensor.__qualname__ = f"{_CLASS}.{_PER_TENSOR}"
    _backward_prologue_per_tensor.__wrapped__ = original
    return _backward_prologue_per_tensor


FIX = EngineBackwardScaleWrtGasIgnored()
