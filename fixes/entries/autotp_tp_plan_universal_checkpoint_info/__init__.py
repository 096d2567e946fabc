"""Fix for autotp-tp-plan-universal-checkpoint-info: upstream PR #8187's change, as a wrapper of
``DeepSpeedEngine._apply_autotp_partitioning``.

``_apply_autotp_partitioning(model, tp_config)`` shards the model while ``deepspeed.initialize`` builds the engine,
by one of three routes: a custom ``partition_config``, the model's Hugging Face ``tp_plan``, or AutoTP's own
heuristics. The first and the last end with ``setattr(model, UNIVERSAL_CHECKPOINT_INFO,
collect_autotp_universal_checkpoint_info(model))`` (``_save_checkpoint`` writes that attribute into the checkpoint);
the tp_plan route returns without it. Upstream PR #8187 adds the same ``setattr`` before that ``return``.

The wrapper does the same after the original returns, without copying it: where this call parsed the model (its
``ds_autotp_parsed`` flag was unset and is set now), the engine's ``autotp_size()`` is above one, and the model still
carries no ``UNIVERSAL_CHECKPOINT_INFO``, it attaches ``collect_autotp_universal_checkpoint_info(model)``. Only the
tp_plan route leaves a sharded model in that state: the other two attach the info themselves (the wrapper then does
nothing), and with ``autotp_size`` 1 nothing is sharded, as upstream's own code leaves it. The method is looked up on
every engine build, so apply before ``deepspeed.initialize``.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_ENGINE = "deepspeed.runtime.engine"
_TARGET = Target(_ENGINE, "DeepSpeedEngine._apply_autotp_partitioning")
# attaching the info: the setattr itself, or (later releases) the shared finish of every route asked to attach it
_ATTACH = re.compile(r"setattr\(\s*model\s*,\s*UNIVERSAL_CHECKPOINT_INFO\s*,|attach_uc_metadata\s*=\s*True")


def _tp_plan_branch(source: str) -> str | None:
    """The body of ``if hf_tp_plan:`` up to its first ``return`` (the route that shards by the tp_plan), or None."""
    start = source.find("if hf_tp_plan:")
    if start < 0:
        return None
    branch = source[start:]
    end = re.search(r"\n\s*return\b", branch)
    return branch[:end.end()] if end else branch


class AutotpTpPlanUniversalCheckpointInfo(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        engine = getattr(import_target_module(_ENGINE), "DeepSpeedEngine")
        method = vars(engine).get("_apply_autotp_partitioning")
        if method is None:
            return Probe(False, "DeepSpeedEngine has no _apply_autotp_partitioning (no AutoTP training partitioning)")
        source = inspect.getsource(method)
        branch = _tp_plan_branch(source)
        if branch is None:
            return Probe(False, "DeepSpeedEngine._apply_autotp_partitioning has no HuggingFace tp_plan route (a "
                                "model's tp_plan is not read)")
        if not _ATTACH.search(source):
            return Probe(False, "DeepSpeedEngine._apply_autotp_partitioning attaches no universal checkpoint info on "
                                "any route (no AutoTP universal checkpoint support)")
        if _ATTACH.search(branch):
            return Probe(False, "the HuggingFace tp_plan route of DeepSpeedEngine._apply_autotp_partitioning "
                                "attaches UNIVERSAL_CHECKPOINT_INFO before it returns")
        return Probe(True, "the HuggingFace tp_plan route of DeepSpeedEngine._apply_autotp_partitioning replaces the "
                           "modules and returns without setattr(model, UNIVERSAL_CHECKPOINT_INFO, "
                           "collect_autotp_universal_checkpoint_info(model)), which its other routes attach")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_attach_the_info)]


def _attach_the_info(original: Any) -> Any:
    @functools.wraps(original)
    def _apply_autotp_partitioning(self, model, tp_config):
        parsed_before = getattr(model, "ds_autotp_parsed", False)
        result = original(self, model, tp_config)
        if parsed_before or not getattr(model, "ds_autotp_parsed", False) or self.autotp_size() <= 1:
            return result
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
        from deepspeed.module_inject.layers import collect_autotp_universal_checkpoint_info

        if getattr(model, UNIVERSAL_CHECKPOINT_INFO, None) is None:
            setattr(model, UNIVERSAL_CHECKPOINT_INFO, collect_autotp_universal_checkpoint_info(model))
        return result

    return _apply_autotp_partitioning


FIX = AutotpTpPlanUniversalCheckpointInfo()
