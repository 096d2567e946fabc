"""Fix for zero3-fp32-grad-accum-through-bf16: the backport of upstream PR #8056, two wrappers.

ZeRO-3 reduces gradients in ``__avg_scatter_contiguous_grads`` (``contiguous_gradients`` with
``reduce_scatter: false``) or ``__avg_scatter_grads`` (the default ``reduce_scatter: true``, or gradients that do
not fit the bucket); both end with ``if communication_data_type != self.dtype: ... .to(self.dtype)``, and PR
#8056 changes that last cast (only that one) to ``self.gradient_accumulation_dtype``. The wrappers make exactly
that change without copying either method (their bodies differ from release to release: the muon update,
ZenFlow, qgZ): for the duration of the call the optimizer's ``dtype`` reads as its gradient accumulation dtype,
and the method's own code does the rest. Where the two dtypes are the same (no ``grad_accum_dtype`` set, or fp32
training) the original is called as it is.

``self.dtype`` has one other use in those methods: ``__avg_scatter_grads`` first casts the gradients to the
communication dtype ``if communication_data_type != self.dtype``. Where the communication dtype is the
accumulation dtype but not the model dtype (bf16 training, fp32 communication and accumulation), that check would
now be false, so the wrapper makes that cast itself first, on the parameters' ``.grad`` (``grad.data`` set to the
cast tensor, as ``__add_grad_to_ipg_bucket`` does with every gradient it moves into a bucket). Every other
combination of the three dtypes takes the same casts as upstream's code. Upstream also makes the padded short
partition of ``__avg_scatter_contiguous_grads`` ``gradient_accumulation_dtype``; the method gives it
``param.grad``'s dtype, which from 0.17.2 on is the communication dtype (the bucket's) and holds the values reduced
in it exactly. Up to 0.17.1 the bucket is in the model dtype, so the wrapper first casts the ``.grad`` of each
parameter it would pad to the communication dtype. PR #8056's third change, the padded chunk of the Muon momentum
update (``_apply_distributed_muon_update``, from 0.18.9 on), is not ported: that chunk takes the dtype of the
gradient's view in the communication-dtype bucket, the accumulation dtype in the configuration this entry is about
(fp32 communication and accumulation). None of the optimizer's methods that the wrapped calls call reads
``self.dtype``.

Apply before or after the engine is built: the methods are looked up on every reduction. The probe reads whether
either method casts the reduced gradients ``.to(self.dtype)``.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, DecoratedTarget, import_target_module, undecorated

_STAGE3 = "deepspeed.runtime.zero.stage3"
_CLASS = "DeepSpeedZeroOptimizer_Stage3"
_CONTIGUOUS = DecoratedTarget(_STAGE3, f"{_CLASS}._{_CLASS}__avg_scatter_contiguous_grads")
_SCATTER = DecoratedTarget(_STAGE3, f"{_CLASS}._{_CLASS}__avg_scatter_grads")
# the buggy cast of the reduced gradients back to the model's dtype
_CAST_TO_MODEL_DTYPE = re.compile(r"\.to\(\s*self\.dtype\s*\)")


class Zero3Fp32GradAccumThroughBf16(Fix):
    targets = (_CONTIGUOUS, _SCATTER)

    def read_code(self) -> Probe:
        stage3 = getattr(import_target_module(_STAGE3), _CLASS)
        casting = []
        for target in self.targets:
            stored = target.qualname.split(".")[-1]  # the mangled name: _DeepSpeedZeroOptimizer_Stage3__avg_...
            if _CAST_TO_MODEL_DTYPE.search(inspect.getsource(undecorated(vars(stage3)[stored]))):
                casting.append("__" + stored.split("__", 1)[1])
        if not casting:
            return Probe(False, "ZeRO-3's gradient reductions cast the reduced gradients to "
                                "gradient_accumulation_dtype, not to the model dtype")
        accumulates = "gradient_accumulation_dtype" in inspect.getsource(undecorated(vars(stage3)["partition_grads"]))
        if not accumulates:
            return Probe(False, "ZeRO-3's partition_grads does not accumulate in a gradient_accumulation_dtype")
        return Probe(True, f"ZeRO-3's {' and '.join(casting)} cast the reduced gradients .to(self.dtype), the model "
                           "dtype, before partition_grads adds them to the gradient_accumulation_dtype buffers")

    def patches(self) -> list[AttributePatch]:
        return [_CONTIGUOUS.wrap(_reduced_into_accumulation_dtype(_pad_in_communication_dtype)),
                _SCATTER.wrap(_reduced_into_accumulation_dtype(_cast_to_communication_dtype))]


def _communication_dtype(optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's communication dtype: its second argument from 0.17.2 on (one bucket per dtype), else the
    optimizer's ``communication_data_type``."""
    if "communication_data_type" in kwargs:
        return kwargs["communication_data_type"]
    return args[1] if len(args) > 1 else optimizer.communication_data_type


def _cast_to_communication_dtype(optimizer: Any, communication_dtype: Any, args: tuple[Any, ...],
                                 kwargs: dict[str, Any]) -> None:
    """Before ``__avg_scatter_grads``: its first cast, ``if communication_data_type != self.dtype:
    g.to(communication_data_type)``, which the accumulation dtype in ``self.dtype`` skips where the communication
    dtype is the accumulation dtype; made here on the parameters' ``.grad``."""
    if communication_dtype != optimizer.gradient_accumulation_dtype:
        return  # the original's check still holds: it makes the cast itself
    params = kwargs["params_to_reduce"] if "params_to_reduce" in kwargs else args[0]
    for param in params:
        if param.grad is not None and param.grad.dtype != communication_dtype:
            param.grad.data = param.grad.data.to(communication_dtype)


def _pad_in_communication_dtype(optimizer: Any, communication_dtype: Any, args: tuple[Any, ...],
                                kwargs: dict[str, Any]) -> None:
    """Before ``__avg_scatter_contiguous_grads``: it pads a rank's short partition of a parameter in a new tensor
    of ``param.grad``'s dtype (upstream: ``gradient_accumulation_dtype``). Up to 0.17.1 the gradients wait for the
    reduction in a bucket of the model's dtype, so that padding would round the reduced values to bf16 again; here
    the ``.grad`` of every parameter whose size does not divide by the world size is cast to the communication
    dtype first, which holds the reduced values exactly. From 0.17.2 on the bucket is already in the communication
    dtype and nothing is cast. The method reads only ``.grad``'s size, dtype and device; the values it reduces are
    in the bucket it is called with."""
    dist = import_target_module(_STAGE3).dist
    world_size = dist.get_world_size(optimizer.dp_process_group)
    buckets = getattr(optimizer, "ipg_buckets", None)
    params = buckets[communication_dtype].params if buckets is not None else optimizer.params_in_ipg_bucket
    for param in params:
        grad = param.grad
        if grad is not None and grad.dtype != communication_dtype and grad.numel() % world_size:
            param.grad.data = grad.data.to(communication_dtype)


def _reduced_into_accumulation_dtype(prepare: Any) -> Any:
    def make(original: Any) -> Any:
        @functools.wraps(original)
        def reduce(self, *args, **kwargs):
            model_dtype = self.dtype
            accumulation_dtype = getattr(self, "gradient_accumulation_dtype", model_dtype)
            if accumulation_dtype == model_dtype:
                return original(self, *args, **kwargs)
            prepare(self, _communication_dtype(self, args, kwargs), args, kwargs)
            # PR #8056: the reduced gradients are cast to gradient_accumulation_dtype, not to the model dtype
            self.dtype = accumulation_dtype
            try:
                return original(self, *args, **kwargs)
            finally:
                self.dtype = model_dtype

        return reduce

    return make


FIX = Zero3Fp32GradAccumThroughBf16()
