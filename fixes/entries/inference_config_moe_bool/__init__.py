"""Fix for inference-config-moe-bool: replaces the code of ``DeepSpeedInferenceConfig.moe_backward_compat``.

The validator is a pydantic ``field_validator``: pydantic compiles the function into the model's validator when the
class is created, so setting another function on the class would not reach ``DeepSpeedInferenceConfig(...)`` (nor
``init_inference``, which builds it). The function object pydantic calls is the one stored on the class (its
``classmethod``'s ``__func__``); the fix swaps that function's ``__code__`` for the same source with upstream PR
#8145's one change, ``DeepSpeedMoEConfig(moe=field_value)`` -> ``DeepSpeedMoEConfig(enabled=field_value)``, compiled
at the installed file's line numbers under a file name of its own registered with ``linecache`` (tracebacks and
``inspect.getsource`` show the code that runs). Revert puts the original code object back on the same function, so
every reference to the validator (the class, pydantic's schema) sees the original again. ``DeepSpeedMoEConfig`` is
looked up in the module's globals at call time, as before. Apply it before building the config (``init_inference``).

The probe reads the installed source: affected when ``moe_backward_compat`` builds ``DeepSpeedMoEConfig`` with a
keyword that is none of ``DeepSpeedMoEConfig``'s fields (nor their aliases), as ``moe=`` is.
"""
from __future__ import annotations

import ast
import hashlib
import inspect
import linecache
import textwrap
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, edited_source, import_target_module

_MODULE = "deepspeed.inference.config"
_VALIDATOR = Target(_MODULE, "DeepSpeedInferenceConfig.moe_backward_compat")
_MOE_CONFIG = "DeepSpeedMoEConfig"
_BUGGY, _FIXED = "DeepSpeedMoEConfig(moe=field_value)", "DeepSpeedMoEConfig(enabled=field_value)"


class InferenceConfigMoeBool(Fix):
    targets = (_VALIDATOR,)

    def read_code(self) -> Probe:
        module = import_target_module(_MODULE)
        config = getattr(module, "DeepSpeedInferenceConfig", None)
        if config is None or "moe_backward_compat" not in vars(config):
            return Probe(False, "DeepSpeedInferenceConfig has no moe_backward_compat validator: a bool moe is not "
                                "turned into a DeepSpeedMoEConfig here")
        accepted = _field_names(getattr(module, _MOE_CONFIG))
        tree = ast.parse(textwrap.dedent(_VALIDATOR.source()))
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", getattr(node.func, "attr", None)) == _MOE_CONFIG]
        if not calls:
            return Probe(False, "moe_backward_compat builds no DeepSpeedMoEConfig")
        unknown = sorted({keyword.arg for call in calls for keyword in call.keywords
                          if keyword.arg is not None and keyword.arg not in accepted})
        if unknown:
            return Probe(True, f"moe_backward_compat turns a bool moe into DeepSpeedMoEConfig("
                               f"{', '.join(f'{name}=...' for name in unknown)}), which is not a field of "
                               f"DeepSpeedMoEConfig (extra fields are forbidden: the config raises a ValidationError)")
        used = sorted({keyword.arg for call in calls for keyword in call.keywords if keyword.arg is not None})
        return Probe(False, f"moe_backward_compat builds DeepSpeedMoEConfig({', '.join(f'{n}=...' for n in used)}), "
                            "a field it has")

    def patches(self) -> list[AttributePatch]:
        function = _VALIDATOR.code()
        return [AttributePatch(function, "__code__", _fixed_code(function))]


def _field_names(model: Any) -> set[str]:
    """The names a pydantic model accepts: its fields and their aliases (pydantic 2's ``model_fields``, pydantic 1's
    ``__fields__``)."""
    fields = getattr(model, "model_fields", None)
    if fields is None:
        fields = getattr(model, "__fields__", {})
    names = set(fields)
    for field in fields.values():
        alias = getattr(field, "alias", None)
        if alias:
            names.add(alias)
    return names


def _fixed_code(function: Any) -> Any:
    """``function``'s code compiled again from its installed source with upstream's change (``enabled=`` for
    ``moe=``), its decorator dropped (pydantic already holds the function), at the installed line numbers."""
    dotted = _VALIDATOR.dotted
    source = textwrap.dedent(edited_source(function, _BUGGY, _FIXED, dotted))
    tree = ast.parse(source)
    definition = tree.body[0]
    if not isinstance(definition, ast.FunctionDef) or definition.name != function.__name__:
        raise DriftError(f"{dotted}: its source is not one function definition; nothing was patched")
    _, first = inspect.getsourcelines(function)
    definition.decorator_list = []  # its line numbers stay the installed file's
    ast.increment_lineno(tree, first - 1)
    text = "\n" * (first - 1) + source
    filename = (f"<fixes inference-config-moe-bool: {inspect.getsourcefile(function)} "
                f"{hashlib.sha256(text.encode()).hexdigest()[:12]}>")
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(tree, filename, "exec"), dict(function.__globals__), namespace)  # noqa: S102
    code = namespace[function.__name__].__code__
    original = function.__code__
    if code.co_freevars != original.co_freevars or code.co_argcount != original.co_argcount:
        raise DriftError(f"{dotted}: the fixed code takes other arguments or closure variables; nothing was patched")
    if hasattr(original, "co_qualname"):  # Python 3.11+
        code = code.replace(co_qualname=original.co_qualname)
    return code


FIX = InferenceConfigMoeBool()
