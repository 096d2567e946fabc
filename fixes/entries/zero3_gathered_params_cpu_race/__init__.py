"""``deepspeed.zero.GatheredParameters`` over several ZeRO-3 parameters on CPU (gloo) can hand back
uninitialised memory: DeepSpeed waits for the last of its asynchronous all-gathers only.

``Init._allgather_params_coalesced`` (``deepspeed/runtime/zero/partition_parameters.py``) launches
one ``async_op=True`` all-gather per parameter into ``torch.empty`` buffers, calls
``launch_handles[-1].wait()``, points each ``param.data`` at its buffer and then relies on
``get_accelerator().synchronize()``. On CUDA the collectives run in order on one stream and that
synchronize covers them all. On the CPU accelerator ``resolves_data_dependency()`` is True, so the
synchronize is skipped, and gloo runs each asynchronous collective on its own worker thread, in no
order: the earlier parameters may still be in flight.

The fix gathers one parameter per call of the original function (its only handle is its last, so
it is waited for), on accelerators that skip the synchronize; on CUDA it changes nothing. Upstream
PR #8539 waits for every handle instead. Apply it any time: the function is looked up on every gather.

Upstream rewrote the function once (each parameter's own partition group size instead of
``self.num_partitions``; callers pass one process group per call) and kept the last-handle wait;
the signature and the ``None`` return are unchanged, so the same wrapper applies to both versions.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.partition_parameters"
_CLASS = "Init"
_FUNCTION = "_allgather_params_coalesced"
_WAITS_LAST_ONLY = "launch_handles[-1].wait()"


class Zero3GatheredParamsCpuRace(Fix):
    targets = (Target(_MODULE, f"{_CLASS}.{_FUNCTION}"),)

    def read_code(self) -> Probe:
        init = getattr(import_target_module(_MODULE), _CLASS)
        function = vars(init)[_FUNCTION]
        if _WAITS_LAST_ONLY not in inspect.getsource(function):
            return Probe(False, f"{_CLASS}.{_FUNCTION} waits for every all-gather handle")
        if not _skips_synchronize():
            return Probe(False, f"{_CLASS}.{_FUNCTION} waits for the last handle only, but this accelerator's "
                                "synchronize() orders all of them (the race needs the CPU accelerator)")
        return Probe(True, f"{_CLASS}.{_FUNCTION} waits for the last handle only and this accelerator skips "
                           "the synchronize that would cover the others")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].wrap(_one_at_a_time)]


def _skips_synchronize() -> bool:
    """Whether DeepSpeed skips ``synchronize()`` after the gather on this accelerator (the CPU one)."""
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().resolves_data_dependency())


def _one_at_a_time(original: Any) -> Any:
    @functools.wraps(original)
    def _allgather_params_coalesced(self, param_list, hierarchy=0, quantize=False):
        if len(param_list) <= 1 or not _skips_synchronize():
            return original(self, param_list, hierarchy, quantize)
        # One parameter per call: the call's only handle is its last one, which it waits for. Same
        # order on every rank (param_list is sorted by ds_id), so the collectives still match.
        for param in param_list:
            original(self, [param], hierarchy, quantize)
        return None  # like the original: "always return None"

    return _allgather_params_coalesced


FIX = Zero3GatheredParamsCpuRace()
