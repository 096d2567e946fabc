"""Fix for load-checkpoint-refresh-fp32-params-missing: wraps ``DeepSpeedEngine._load_checkpoint``.

With ``load_module_only=True`` the installed ``_load_checkpoint`` calls ``self.optimizer.refresh_fp32_params()``
on whatever optimizer the engine holds. Only DeepSpeed's own wrappers (BF16_Optimizer, the fp16 optimizers,
ZeRO-1/2/3) define it: they keep an fp32 master copy of the weights that must be refreshed from the loaded module.
A torch (or any client) optimizer, which the engine holds as it is for fp32 without ZeRO, steps the module's own
parameters: there is no copy to refresh, and the call raises AttributeError.

The wrapper does what upstream PR #7133 does (``hasattr(self.optimizer, 'refresh_fp32_params')`` before the
call): for the duration of the original ``_load_checkpoint`` with ``load_module_only=True`` and an optimizer
lacking the method, the optimizer instance gets a no-op ``refresh_fp32_params`` attribute, removed again
afterwards (also when the load raises). Every other call goes straight to the original.

The probe reads ``_load_checkpoint``'s source: affected when it calls ``self.optimizer.refresh_fp32_params()``
without testing ``hasattr(self.optimizer, 'refresh_fp32_params')``.
"""
from __future__ import annotations

import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_LOAD_FILE = Target("deepspeed.runtime.engine", "DeepSpeedEngine._load_checkpoint")
_CALL = "self.optimizer.refresh_fp32_params()"
_GUARD = "hasattr(self.optimizer, 'refresh_fp32_params')"
_METHOD = "refresh_fp32_params"


class LoadCheckpointRefreshFp32ParamsMissing(Fix):
    targets = (_LOAD_FILE,)

    def read_code(self) -> Probe:
        source = textwrap.dedent(inspect.getsource(_LOAD_FILE.code()))
        if _CALL not in source:
            return Probe(False, "_load_checkpoint does not call self.optimizer.refresh_fp32_params()")
        if _GUARD in source.replace('"', "'"):
            return Probe(False, "_load_checkpoint calls refresh_fp32_params only where the optimizer has it")
        return Probe(True, "_load_checkpoint calls self.optimizer.refresh_fp32_params() for load_module_only=True "
                           "on any optimizer, without testing that it has the method")

    def patches(self) -> list[AttributePatch]:
        return [_LOAD_FILE.wrap(_skipping_missing_refresh)]


def _nothing_to_refresh() -> None:
    """A plain optimizer steps the module's own parameters: there is no fp32 master copy to refresh."""


def _skipping_missing_refresh(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _load_checkpoint(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        optimizer = self.optimizer
        if not bound.arguments.get("load_module_only") or optimizer is None or hasattr(optimizer, _METHOD):
            return original(self, *args, **kwargs)
        setattr(optimizer, _METHOD, _nothing_to_refresh)  # upstream PR #7133: skip the call where it is missing
        try:
            return original(self, *args, **kwargs)
        finally:
            if vars(optimizer).get(_METHOD) is _nothing_to_refresh:
                delattr(optimizer, _METHOD)

    return _load_checkpoint


FIX = LoadCheckpointRefreshFp32ParamsMissing()
