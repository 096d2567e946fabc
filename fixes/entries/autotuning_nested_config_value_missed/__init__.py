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

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target

_UTILS = Target("deepspeed.autotuning.utils", "get_val_by_key")
_SCHEDULER = Target("deepspeed.autotuning.scheduler", "get_val_by_key")  # the name run_job calls
_PROBE_DICT = {"first": {"other": 1}, "second": {"key": 2}}


class AutotuningNestedConfigValueMissed(Fix):
    info = FixInfo(
        id="autotuning-nested-config-value-missed",
        title="Autotuning arg_mappings: a key nested in a later config section is never passed to the script",
        summary=("The autotuner (deepspeed --autotuning run/tune) launches each experiment with the user's "
                 "script arguments, after writing the experiment's tuned values into the arguments that "
                 "autotuning.arg_mappings names. A mapped key nested in a config section (zero_optimization's "
                 "\"stage\" mapped to the script's --zero_stage, say) is looked up only in the first section of "
                 "the config that is a dict: when another section (fp16, bf16, optimizer, scheduler...) comes "
                 "first, the lookup answers nothing and the argument is left as the user gave it, or absent. The "
                 "experiment named after ZeRO-3 runs the script at its default stage, the autotuner measures and "
                 "ranks that run under the tuned config's name, and the optimal command it writes "
                 "(cmd_optimal.txt) and launches lacks the tuned value too. Keys at the top of the config "
                 "(train_micro_batch_size_per_gpu, gradient_accumulation_steps) are found. There is no error "
                 "or warning."),
        symptom="silent wrong result",
        kind="bug",
        components=("config", "autotuning"),
        error_signatures=(
            "autotuning arg_mappings not applied to the training script arguments",
            "autotuner does not pass the tuned ZeRO stage to my training script",
            "arg_mappings zero_optimization stage ignored by deepspeed --autotuning",
            "cmd_optimal.txt is missing the tuned zero stage",
            "get_val_by_key returns None for a key in zero_optimization",
            "autotuning experiment z3 runs with ZeRO stage 0",
        ),
        root_cause=("deepspeed/autotuning/utils.py, get_val_by_key: when the key is not in the dict it recurses "
                    "into the first dict-valued entry and returns that search's answer, None included, so the "
                    "entries after it are never searched. deepspeed/autotuning/scheduler.py, "
                    "ResourceManager.run_job, looks up every arg_mappings key in the experiment "
                    "({\"name\", \"ds_config\", ...}) with it: the search goes into ds_config, then into the first "
                    "section of ds_config that is a dict, and a key nested in a later section (zero_optimization."
                    "stage after fp16) comes back None, which the `if nval` guard skips, so the tuned value is "
                    "never written into the script's arguments."),
        reproduce_release="0.19.3",
        upstream_fixed_in="0.19.4",
        upstream_issues=(8176,),
        upstream_prs=(8177,),
        upstream_note=("Fixed by PR #8177 ('Fix autotuning get_val_by_key to search all nested subdicts'): the "
                       "search goes on to the next subdict when one answers None, as set_val_by_key already "
                       "does. Upstream's test covers the helper (a key in the second top-level subdict, an absent "
                       "key, a key in the first subdict, and agreement with set_val_by_key); the PR notes that an "
                       "end-to-end autotuning run was not exercised."),
    )
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
