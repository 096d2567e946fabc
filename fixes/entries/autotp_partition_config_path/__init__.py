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

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_AUTO_TP = "deepspeed.module_inject.auto_tp"
_TARGET = Target(_AUTO_TP, "AutoTP._replace_module")
_BRANCH = "if self.partition_config is not None"
# the name the partition_config branch gives a child, and the prev_name its recursion passes down
_FULL_NAME = re.compile(r"full_name\s*=\s*(\w+)\s*\+\s*'\.'\s*\+\s*name\b")
_RECURSION = re.compile(r"self\._replace_module\(\s*child\s*,\s*(\w+)\s*,\s*class_name\s*\)")


class AutotpPartitionConfigPath(Fix):
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
