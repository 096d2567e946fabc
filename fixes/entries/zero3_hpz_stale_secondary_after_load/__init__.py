"""Fix for zero3-hpz-stale-secondary-after-load: the backport of upstream PR #7707, two wrappers.

* ``Init._partition`` (``deepspeed/runtime/zero/partition_parameters.py``): where it is called with
  ``has_been_updated=True`` (``GatheredParameters.__exit__`` after a ``modifier_rank`` broadcast) and the
  model has an hpZ group, the wrapper first calls ``self._partition_param_sec(param, has_been_updated=True)``
  for each parameter, under ``torch.no_grad()``, so the secondary partition is rewritten from the new full
  weights. That is the call upstream makes (``_partition_param_sec(param, has_been_updated=has_been_updated)``,
  its copy under ``no_grad``); the original's own ``_partition_param_sec(param)`` then finds a secondary copy
  and returns, as it does on a fixed release. Any other call goes straight to the original.
* ``DeepSpeedZeroOptimizer_Stage3.checkpoint_event_epilogue`` (``stage3.py``): calls
  ``self.invalidate_secondary_tensor()`` before the original, as upstream does, so that after
  ``load_checkpoint`` (which writes the primary partitions only) the next gather rebuilds the secondary
  copies from the loaded weights.

Apply before or after the engine is built: both are looked up on every call. The probe reads the call in
``Init._partition`` and the body of ``checkpoint_event_epilogue``.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_PARAMS = "deepspeed.runtime.zero.partition_parameters"
_STAGE3 = "deepspeed.runtime.zero.stage3"
_PARTITION = Target(_PARAMS, "Init._partition")
_EPILOGUE = Target(_STAGE3, "DeepSpeedZeroOptimizer_Stage3.checkpoint_event_epilogue")
# the buggy call: the secondary partition is never told that the weights were updated
_STALE_CALL = re.compile(r"self\._partition_param_sec\(param\)")


class Zero3HpzStaleSecondaryAfterLoad(Fix):
    targets = (_PARTITION, _EPILOGUE)

    def read_code(self) -> Probe:
        init = getattr(import_target_module(_PARAMS), "Init")
        stage3 = getattr(import_target_module(_STAGE3), "DeepSpeedZeroOptimizer_Stage3")
        found = []
        if _STALE_CALL.search(inspect.getsource(vars(init)["_partition"])):
            found.append("Init._partition calls _partition_param_sec(param) without has_been_updated")
        if "invalidate_secondary_tensor" not in inspect.getsource(vars(stage3)["checkpoint_event_epilogue"]):
            found.append("DeepSpeedZeroOptimizer_Stage3.checkpoint_event_epilogue keeps the secondary copies")
        if found:
            return Probe(True, "; ".join(found))
        return Probe(False, "Init._partition passes has_been_updated to _partition_param_sec and "
                            "checkpoint_event_epilogue invalidates the secondary copies")

    def patches(self) -> list[AttributePatch]:
        return [_PARTITION.wrap(_refresh_secondary), _EPILOGUE.wrap(_invalidate_first)]


def _refresh_secondary(original: Any) -> Any:
    @functools.wraps(original)
    def _partition(self, param_list, force=False, has_been_updated=False, *args, **kwargs):
        if has_been_updated and self.zero_param_process_group is not None:
            import torch

            with torch.no_grad():  # upstream copies under no_grad: the secondary copy never requires grad
                for param in param_list:
                    self._partition_param_sec(param, has_been_updated=True)
        return original(self, param_list, force, has_been_updated, *args, **kwargs)

    return _partition


def _invalidate_first(original: Any) -> Any:
    @functools.wraps(original)
    def checkpoint_event_epilogue(self, *args, **kwargs):
        self.invalidate_secondary_tensor()
        return original(self, *args, **kwargs)

    return checkpoint_event_epilogue


FIX = Zero3HpzStaleSecondaryAfterLoad()
