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

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.runtime.zero.parameter_offload"
_REDUCE = Target(_MODULE, "ZeROOrderedDict.__reduce__")
_BROKEN = "(self._parent_module, )) + r2"


class Zero3DeepcopyZeroOrderedDict(Fix):
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
