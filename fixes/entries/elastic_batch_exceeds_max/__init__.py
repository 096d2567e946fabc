"""Fix for elastic-batch-exceeds-max: wraps ``deepspeed.elasticity.elasticity.get_candidate_batch_sizes``.

Elasticity v0.1 (and v0.2, which calls it per node) builds its candidate train batch sizes in
``_get_compatible_gpus_v01`` from a list of *bases*: every micro batch size, and their least common multiple.
``get_candidate_batch_sizes`` scales each base by the largest highly composite number that keeps it under
``max_train_batch_size`` -- except a base at or above the cap, which it keeps as it is. The micro batch sizes are
checked against the cap beforehand; their LCM is not, so an LCM above the cap becomes a candidate, and since it
is divisible by every micro batch size it tends to win ``get_best_candidates``' vote (the most valid GPU counts).

The wrapper drops every base above the cap before calling the original, which is upstream PR #8237's change
(``if base > max_acceptable_batch_size: continue``): scaling such a base only makes it larger, so it can never
give a legal candidate, and every micro batch size is a base within the cap, so the list never ends up empty. A
base equal to the cap is kept as it is, as before. The original function still does the scaling and the logging.
``_get_compatible_gpus_v01`` looks the function up in its module at call time, so patching the module attribute
reaches the engine's ``DeepSpeedConfig``, ``compute_elastic_config`` and the launcher alike. Apply it before
``deepspeed.initialize`` (the config's batch size is computed there).

The probe reads the installed source: affected when ``get_candidate_batch_sizes`` keeps a base ``>=`` the cap as a
candidate (an ``if base >= max_acceptable_batch_size`` that appends ``base``) and ``_get_compatible_gpus_v01``
adds the LCM to the bases. A release without ``deepspeed.elasticity`` (elastic training was removed upstream; the
config refuses an ``"elasticity"`` block) is not affected: it picks no batch size at all.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap
from typing import Any

from ...exceptions import DeepSpeedNotInstalledError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.elasticity.elasticity"
_CANDIDATES = Target(_MODULE, "get_candidate_batch_sizes")
_BASE, _CAP = "base", "max_acceptable_batch_size"


class ElasticBatchExceedsMax(Fix):
    targets = (_CANDIDATES,)

    def read_code(self) -> Probe:
        try:
            module = importlib.import_module(_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name == "deepspeed":
                raise DeepSpeedNotInstalledError(f"cannot import {_MODULE}: DeepSpeed is not installed") from exc
            if exc.name and _MODULE.startswith(exc.name):
                return Probe(False, f"{exc.name} does not exist: this release has no elastic training and its "
                                    "config refuses an 'elasticity' block")
            raise
        candidates = _function_tree(module.get_candidate_batch_sizes)
        kept = [node for node in ast.walk(candidates) if isinstance(node, ast.If) and _cap_at_or_above(node.test)
                and any(_appends(child, _BASE) for child in node.body)]
        if not kept:
            return Probe(False, "get_candidate_batch_sizes keeps no base above max_acceptable_batch_size as a "
                                "candidate: such a base is skipped")
        compatible = getattr(module, "_get_compatible_gpus_v01", None)
        if compatible is None or not any(_appends(node, "lcm") for node in ast.walk(_function_tree(compatible))):
            return Probe(False, "_get_compatible_gpus_v01 does not add the micro batch sizes' LCM to the bases: "
                                "every base is a micro batch size, checked against the cap")
        return Probe(True, "get_candidate_batch_sizes appends a base >= max_acceptable_batch_size unscaled, and "
                           "_get_compatible_gpus_v01 adds the micro batch sizes' LCM to the bases unchecked")

    def patches(self) -> list[AttributePatch]:
        return [_CANDIDATES.wrap(_bases_within_cap)]


def _function_tree(function: Any) -> ast.AST:
    return ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))


def _cap_at_or_above(test: ast.AST) -> bool:
    """``base >= max_acceptable_batch_size`` (or ``max_acceptable_batch_size <= base``)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    left, op, right = test.left, test.ops[0], test.comparators[0]
    names = (getattr(left, "id", None), getattr(right, "id", None))
    return ((names == (_BASE, _CAP) and isinstance(op, ast.GtE)) or
            (names == (_CAP, _BASE) and isinstance(op, ast.LtE)))


def _appends(node: ast.AST, name: str) -> bool:
    """``node`` holds a call ``<list>.append(name)``."""
    return any(isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "append"
               and len(call.args) == 1 and getattr(call.args[0], "id", None) == name for call in ast.walk(node))


def _bases_within_cap(original: Any) -> Any:
    @functools.wraps(original)
    def get_candidate_batch_sizes(base_list, max_acceptable_batch_size):
        # upstream PR #8237: a base above the cap (the micro batch sizes' LCM) only grows when scaled, so it can
        # never give a batch size within the cap; drop it. A base equal to the cap is still kept as it is.
        within = [base for base in base_list if base <= max_acceptable_batch_size]
        return original(within, max_acceptable_batch_size)

    return get_candidate_batch_sizes


FIX = ElasticBatchExceedsMax()
