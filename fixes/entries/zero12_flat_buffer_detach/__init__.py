"""ZeRO-1/2's flat parameter buffer keeps an autograd graph: the first step fails on 2+ ranks.

Where ``DeepSpeedZeroOptimizer.__init__`` flattens each parameter group on the accelerator when it
has room (``flatten_on_gpu``, upstream PR #7828; the CPU accelerator always has room) without
detaching, the parameters require grad, so ``torch.cat`` gives the flat buffer a ``CatBackward0``
graph, and the views handed back to the model are outputs of one multi-output split. After the
first step the all-gather of updated partitions writes into those views in place, which autograd
forbids.

The fix wraps ``flatten_dense_tensors_aligned`` and detaches what it returns, as upstream PR #7948
detaches the flattened buffer. Apply it before ``deepspeed.initialize``: the buffer is made there.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_CLASS = "DeepSpeedZeroOptimizer"
# The on-device flatten call followed by .detach(): how fixed releases build the flat buffer.
_DETACHED_FLATTEN = re.compile(r"use_cpu_data=False(,\s*param_padding=\w+)?\)\.detach\(\)")


class Zero12FlatBufferDetach(Fix):
    targets = (Target(_MODULE, f"{_CLASS}.flatten_dense_tensors_aligned"),)

    def read_code(self) -> Probe:
        cls = getattr(import_target_module(_MODULE), _CLASS)
        source = inspect.getsource(cls.__init__)
        if "flatten_on_gpu" not in source and "flatten_on_accelerator" not in source:
            return Probe(False, f"{_CLASS}.__init__ has no on-device flattening (before PR #7828)")
        if _DETACHED_FLATTEN.search(source):
            return Probe(False, f"{_CLASS}.__init__ detaches the on-device flat buffer")
        return Probe(True, f"{_CLASS}.__init__ flattens on the device without detaching")

    def patches(self) -> list[AttributePatch]:
        return [self.targets[0].wrap(_detaching)]


def _detaching(original: Any) -> Any:
    @functools.wraps(original)
    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False):
        # A flat buffer is storage, never part of a graph: the CPU-offload path already drops the
        # graph with .cpu()/.to(); the on-device path must do it explicitly.
        return original(self, tensor_list, alignment, use_cpu_data).detach()

    return flatten_dense_tensors_aligned


FIX = Zero12FlatBufferDetach()
