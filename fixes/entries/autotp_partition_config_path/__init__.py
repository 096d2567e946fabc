"""Fix for autotp-partition-config-path: upstream PR #8088's change, as a wrapper of ``AutoTP._replace_module``.

``AutoTP._replace_module(r_module, prev_name, prev_class_name)`` walks the model. For each child it computes
``class_name``, the path of ``r_module`` (``prev_class_name + '.' + prev_name``, or whichever of the two is set), and
recurses with ``(child, name, class_name)``. The ``partition_config`` branch of an affected release names the child
``full_name = prev_name + '.' + name``: ``prev_name`` is only ``r_module``'s own name, so from the third level on the
name the patterns see has lost every module above the parent (``mlp.up_proj``, not ``layers.0.mlp.up_proj``).
Upstream PR #8088 builds ``full_name`` from ``class_name`` instead.

The wrapper does the same without copying the function: where ``self.partition_config`` is set, it computes the path
``class_name`` would be (the original's own rule) and calls the original with ``prev_name=path, prev_class_name=''``.
The original then has ``class_name == path`` (so its state-dict keys are unchanged) and ``full_name == path + '.' +
name``, the name upstream's fix gives; its recursion ``self._replace_module(child, name, class_name)`` comes back
through the wrapper, which does the same one level down. Without ``partition_config`` (AutoTP's own ``linear_policies``
path) the original runs untouched. The method is looked up on every call, so apply before ``deepspeed.initialize``
(which shards the model while it builds the engine).
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target, import_target_module

_AUTO_TP = "deepspeed.module_inject.auto_tp"
_TARGET = Target(_AUTO_TP, "AutoTP._replace_module")
_BRANCH = "if self.partition_config is not None"
# the name the partition_config branch gives a child, and the prev_name its recursion passes down
_FULL_NAME = re.compile(r"full_name\s*=\s*(\w+)\s*\+\s*'\.'\s*\+\s*name\b")
_RECURSION = re.compile(r"self\._replace_module\(\s*child\s*,\s*(\w+)\s*,\s*class_name\s*\)")


class AutotpPartitionConfigPath(Fix):
    info = FixInfo(
        id="autotp-partition-config-path",
        title="AutoTP custom partition patterns that name a layer's parent modules never match: nothing is sharded",
        summary=("AutoTP training (tensor_parallel.autotp_size > 1) with a custom tensor_parallel.partition_config, "
                 "or a preset_model such as \"llama\": deepspeed.initialize matches each layer's patterns against a "
                 "name that keeps only the layer's immediate parent (mlp.up_proj.weight instead of "
                 "model.layers.0.mlp.up_proj.weight). A pattern that names a module above the layer itself, as the "
                 "built-in presets do (.*\\.self_attn\\.q_proj\\.weight$, .*\\.mlp\\.down_proj\\.weight$), or the "
                 "path from the model's root (layers\\.\\d+\\.mlp\\...), never matches a layer that sits deeper "
                 "than the second level, which is every layer of a transformer. Those layers are skipped: every "
                 "rank keeps the whole weight, no tensor parallelism happens, and each rank holds the full model's "
                 "memory. No error and no warning; training still gives the numbers of the unsharded model."),
        symptom="silent wrong result",
        kind="bug",
        components=("AutoTP",),
        error_signatures=(
            "AutoTP partition_config patterns not matching",
            "partition_config does nothing, parameters not sharded",
            "autotp_size 2 but each rank has the full weight",
            "preset_model llama does not shard the model",
            "AutoTP custom patterns silently ignored",
            "tensor parallel layers stay nn.Linear after deepspeed.initialize",
            "OOM with AutoTP tensor parallelism, same memory as without TP",
            "ValueError: No matching spec for mlp.up_proj.weight",
            "ValueError: No matching spec for self_attn.q_proj.weight",
        ),
        root_cause=("deepspeed/module_inject/auto_tp.py, AutoTP._replace_module: in the partition_config branch it "
                    "names a child full_name = prev_name + '.' + name, and recurses with "
                    "self._replace_module(child, name, class_name), so prev_name is only the parent module's own "
                    "name. From the third level down full_name drops every module above the parent, and "
                    "AutoTPConfig.find_matching_spec (deepspeed/module_inject/autotp_config.py, re.match of each "
                    "TPLayerSpec pattern against full_name + '.weight') finds no spec for a pattern that names those "
                    "modules: _replace_with_config leaves the layer unsharded. class_name, computed beside it, is "
                    "the whole path."),
        reproduce_release="0.18.8",
        upstream_fixed_in="0.19.3",
        upstream_prs=(8088,),
        upstream_note=("PR #8088 ('fix: AutoTP partition_config uses full hierarchical module path', first released "
                       "in 0.19.3) builds full_name from class_name. Before it, PR #7901 ('Add HuggingFace tp_plan "
                       "support for AutoTP', 0.18.9) had changed the same branch's recursion to pass full_name down "
                       "as the next prev_name, which already gives the patterns the whole path; PR #8088's own test "
                       "passes on the release before it. The custom patterns came with PR #7806 ('Support custom "
                       "partitioning patterns for AutoTP'). With \"strict_mode\": true the unmatched layer raises "
                       "'No matching spec for mlp.up_proj.weight', naming the truncated name."),
    )
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        auto_tp = getattr(import_target_module(_AUTO_TP), "AutoTP")
        source = inspect.getsource(vars(auto_tp)["_replace_module"])
        start = source.find(_BRANCH)
        if start < 0:
            return Probe(False, "AutoTP._replace_module has no partition_config branch (no custom partition patterns)")
        branch = source[start:]
        end = re.search(r"\n\s*elif child\.__class__ in self\.linear_policies", branch)
        branch = branch[:end.start()] if end else branch
        named, passed = _FULL_NAME.search(branch), _RECURSION.search(branch)
        if named is None or passed is None:
            return Probe(False, "AutoTP._replace_module's partition_config branch does not build full_name from "
                                "prev_name + '.' + name")
        if named.group(1) == "class_name":
            return Probe(False, "the partition_config branch of AutoTP._replace_module builds full_name from "
                                "class_name, the whole path")
        if named.group(1) == "prev_name" and passed.group(1) == "full_name":
            return Probe(False, "the partition_config branch of AutoTP._replace_module passes full_name down as the "
                                "next prev_name, so full_name = prev_name + '.' + name is the whole path")
        if named.group(1) == "prev_name" and passed.group(1) == "name":
            return Probe(True, "the partition_config branch of AutoTP._replace_module builds full_name = prev_name + "
                               "'.' + name but passes only the child's own name down as the next prev_name: the "
                               "patterns see the parent's name, not the whole path")
        return Probe(False, f"the partition_config branch of AutoTP._replace_module builds full_name from "
                            f"{named.group(1)} and passes {passed.group(1)} down")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_pass_the_path)]


def _pass_the_path(original: Any) -> Any:
    @functools.wraps(original)
    def _replace_module(self, r_module, prev_name='', prev_class_name=''):
        if getattr(self, "partition_config", None) is None:
            return original(self, r_module, prev_name, prev_class_name)
        # r_module's path, by the original's own rule for class_name
        if prev_class_name == "":
            path = prev_name
        elif prev_name == "":
            path = prev_class_name
        else:
            path = prev_class_name + '.' + prev_name
        return original(self, r_module, path, '')

    return _replace_module


FIX = AutotpPartitionConfigPath()
