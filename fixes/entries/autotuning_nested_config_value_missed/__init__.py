"""Fix for autotuning-nested-config-value-missed: replaces ``deepspeed.autotuning.utils.get_val_by_key`` and the
name ``deepspeed.autotuning.scheduler`` imported it under (``from .utils import get_val_by_key``), which is the one
DeepSpeed calls: ``ResourceManager.run_job`` looks up every ``arg_mappings`` key in the experiment with it.

The replacement is upstream PR #8177's function: a key of the dict itself is returned at once; otherwise every
dict-valued entry is searched in order and the first search that finds something (not ``None``) wins; ``None``
where no subdict holds the key. The installed function returns the first subdict's answer, ``None`` included, and
never looks at the subdicts after it. Both names get the same replacement object; the autotuner's other modules
(``autotuner``, the tuners) import the name with ``from .utils import *`` but never call it, so they are left alone.
Apply it before the autotuner schedules its experiments (``ResourceManager.run_job`` reads the module's name at
every call, so a ``ResourceManager`` built before the fix is served too).

The probe calls the installed function (under any wrapper) on ``{"first": {"other": 1}, "second": {"key": 2}}``:
affected when it answers ``None`` for ``"key"``, the value in the second subdict.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_UTILS = Target("deepspeed.autotuning.utils", "get_val_by_key")
_SCHEDULER = Target("deepspeed.autotuning.scheduler", "get_val_by_key")  # the name run_job calls
_PROBE_DICT = {"first": {"other": 1}, "second": {"key": 2}}


class AutotuningNestedConfigValueMissed(Fix):
    targets = (_UTILS, _SCHEDULER)

    def read_code(self) -> Probe:
        answers = {}
        for target in self.targets:
            function = inspect.unwrap(target.raw())
            answers[target.dotted] = function(_PROBE_DICT, "key")
        missed = [name for name, answer in answers.items() if answer is None]
        shown = ", ".join(f"{name}({_PROBE_DICT}, 'key') returns {answer!r}" for name, answer in answers.items())
        if missed:
            return Probe(True, f"{shown}: it stops after the first nested dict it searches")
        return Probe(False, f"{shown}: it searches every nested dict")

    def patches(self) -> list[AttributePatch]:
        fixed = _searching_every_subdict(_UTILS.raw())
        return [_UTILS.replace(fixed), _SCHEDULER.replace(fixed)]


def _searching_every_subdict(original: Any) -> Any:
    @functools.wraps(original)
    def get_val_by_key(d: dict, k):
        if k in d:
            return d[k]
        for v in d.values():
            if isinstance(v, dict):
                found = get_val_by_key(v, k)  # upstream PR #8177: a subdict without the key does not end the search
                if found is not None:
                    return found
        return None

    return get_val_by_key


FIX = AutotuningNestedConfigValueMissed()
