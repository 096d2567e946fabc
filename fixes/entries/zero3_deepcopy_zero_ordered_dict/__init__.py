"""Fix for zero3-deepcopy-zero-ordered-dict: the backport of upstream PR #6794, which replaces
``deepspeed.runtime.zero.parameter_offload.ZeROOrderedDict.__reduce__``.

ZeRO-3 replaces every module's ``_parameters`` by a ``ZeROOrderedDict`` (``_inject_parameters``). Its
``__reduce__`` keeps ``OrderedDict.__reduce__``'s answer but swaps the constructor arguments for
``(self._parent_module,)``: ``r0, _, *r2 = super().__reduce__()``, then ``(r0, (parent,)) + r2``. The starred
assignment makes ``r2`` a *list*, and a tuple plus a list is a TypeError, so ``copy.deepcopy``, ``pickle`` and
``torch.save`` of any module that holds one fail. Upstream returns ``(r0, (parent,)) + tuple(r2)``.

The replacement is that method as upstream wrote it; nothing else changes. A module deep-copied or pickled
before the fix was applied never existed (the copy failed), so there is no old state to repair.

The probe reads the installed ``ZeROOrderedDict.__reduce__``: affected when it adds ``r2`` to a tuple without
``tuple(r2)``.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.runtime.zero.parameter_offload"
_REDUCE = Target(_MODULE, "ZeROOrderedDict.__reduce__")
_BROKEN = "(self._parent_module, )) + r2"


class Zero3DeepcopyZeroOrderedDict(Fix):
    info = FixInfo(
        id="zero3-deepcopy-zero-ordered-dict",
        title="ZeRO-3: copy.deepcopy, pickle or torch.save of the model fails in ZeROOrderedDict.__reduce__",
        summary=("After deepspeed.initialize with ZeRO-3, copy.deepcopy(model) -- an EMA copy, the frozen "
                 "reference model of RLHF/DPO, a snapshot of the best model -- and pickle.dumps(model) or "
                 "torch.save(model) fail at once with TypeError: can only concatenate tuple (not \"list\") to "
                 "tuple, raised from ZeROOrderedDict.__reduce__ in deepspeed/runtime/zero/parameter_offload.py. "
                 "Every module's parameter dict is a ZeROOrderedDict under ZeRO-3, so any copy or pickle of the "
                 "model (or of a submodule) fails; ZeRO-1/2 copy the same model. With the fix the deep copy is made "
                 "(inside deepspeed.zero.GatheredParameters it holds the full weights); pickling the whole module "
                 "then still fails, later, on objects a ZeRO-3 module holds (DeepSpeed's hooks, the process group): "
                 "save a state dict instead."),
        symptom="crash",
        kind="bug",
        components=("ZeRO-3",),
        error_signatures=(
            "TypeError: can only concatenate tuple (not \"list\") to tuple",
            "can only concatenate tuple (not \"list\") to tuple",
            "return (r0, (self._parent_module, )) + r2",
            "ZeROOrderedDict __reduce__ TypeError",
            "copy.deepcopy(model) fails with ZeRO-3",
            "torch.save(model) ZeRO-3 can only concatenate tuple",
            "EMA model deepcopy deepspeed stage 3 TypeError",
        ),
        root_cause=("deepspeed/runtime/zero/parameter_offload.py, ZeROOrderedDict.__reduce__: "
                    "`r0, _, *r2 = super().__reduce__()` collects the rest of OrderedDict's reduce value into a "
                    "list, and `return (r0, (self._parent_module, )) + r2` adds that list to a tuple (TypeError). "
                    "ZeRO-3 puts a ZeROOrderedDict in every module's _parameters (_inject_parameters, from "
                    "DeepSpeedZeRoOffload.__init__), and copy.deepcopy and pickle call __reduce_ex__, which calls "
                    "this __reduce__, for each of them."),
        reproduce_release="0.16.0",
        upstream_fixed_in="0.16.2",
        upstream_prs=(6794,),
        upstream_note=("Fixed by PR #6794 ('Fix type error in ZeROOrderedDict', first released in 0.16.2), which "
                       "returns `(r0, (self._parent_module, )) + tuple(r2)`. The PR adds no test."),
    )
    targets = (_REDUCE,)

    def read_code(self) -> Probe:
        source = inspect.getsource(_REDUCE.code())
        if _BROKEN in source and "tuple(r2)" not in source:
            return Probe(True, "ZeROOrderedDict.__reduce__ returns `(r0, (self._parent_module, )) + r2` with r2 a "
                               "list (from `r0, _, *r2 = ...`): tuple + list raises TypeError")
        return Probe(False, "ZeROOrderedDict.__reduce__ does not add the list r2 to a tuple")

    def patches(self) -> list[AttributePatch]:
        return [_REDUCE.replace(__reduce__)]


def __reduce__(self: Any) -> Any:
    """Upstream's ``ZeROOrderedDict.__reduce__`` (PR #6794): OrderedDict's reduce value with the constructor
    arguments ``(parent_module,)``, as one tuple."""
    r0, _, *r2 = OrderedDict.__reduce__(self)
    return (r0, (self._parent_module, )) + tuple(r2)


FIX = Zero3DeepcopyZeroOrderedDict()
