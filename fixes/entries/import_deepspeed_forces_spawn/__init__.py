"""Fix for import-deepspeed-forces-spawn: undoes what importing ``deepspeed.runtime.checkpoint_engine.
decoupled_checkpoint_engine`` did to the process's multiprocessing default context, and moves the ``spawn`` choice
to where PR #7349 (and, in its final form, later releases) put it: ``DecoupledCheckpointEngine.__init__``.

Two patches:

* ``multiprocessing``'s default context (``multiprocessing.context._default_context``, which
  ``torch.multiprocessing`` shares) gets ``_actual_context = None`` back: no start method chosen, as before
  ``import deepspeed``. ``multiprocessing.set_start_method(...)`` then works once, as in any Python process, and a
  job that never chooses gets the platform's default (``fork`` on Linux up to Python 3.13).
* ``DecoupledCheckpointEngine.__init__`` is wrapped to choose ``spawn`` first where nothing was chosen yet
  (``mp.set_start_method('spawn')``, ignoring the ``RuntimeError`` where the user has chosen), so the decoupled
  checkpoint writer still starts its process with ``spawn`` unless the user said otherwise, as upstream does now.

Limits, both in the nature of the bug:

* The module's ``set_start_method('spawn', force=True)`` runs when ``deepspeed`` is imported, before any fix can
  be applied, and ``force=True`` overwrites a start method the script chose *before* importing deepspeed: that
  choice is lost and the fix cannot know it. Choose the start method after ``fixes.apply()`` (or set it again).
* ``fixes.revert()`` refuses once the user has chosen a start method after ``fixes.apply()``: the default
  context's ``_actual_context`` is no longer what the fix put there, and the framework does not put back an
  attribute that was set over its patch (reverting would silently drop the user's choice). Leave the fix applied.

The probe reads the installed module's source (its top level, through the AST) for a ``set_start_method`` call
that runs at import; the drift check fingerprints the whole module (the call is no function's code) and
``DecoupledCheckpointEngine.__init__``.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_PACKAGE = "deepspeed.runtime.checkpoint_engine"
_NAME = "decoupled_checkpoint_engine"
_MODULE = f"{_PACKAGE}.{_NAME}"
_MODULE_TARGET = Target(_PACKAGE, _NAME)  # the module itself: its top-level set_start_method call
_INIT = Target(_MODULE, "DecoupledCheckpointEngine.__init__")


class ImportDeepspeedForcesSpawn(Fix):
    targets = (_MODULE_TARGET, _INIT)

    def read_code(self) -> Probe:
        package = import_target_module(_PACKAGE)
        if importlib.util.find_spec(_MODULE) is None:
            return Probe(False, f"{package.__name__} has no {_NAME} module (no decoupled checkpointing)")
        module = import_target_module(_MODULE)
        calls = _top_level_start_method_calls(inspect.getsource(module))
        if not calls:
            return Probe(False, f"{_MODULE} calls set_start_method only inside functions, not at import")
        return Probe(True, f"{_MODULE} runs {calls[0]} at import, so importing deepspeed chooses the process's "
                           "multiprocessing start method")

    def patches(self) -> list[AttributePatch]:
        import multiprocessing.context

        return [AttributePatch(multiprocessing.context._default_context, "_actual_context", None),
                _INIT.wrap(_spawn_unless_chosen)]


def _top_level_start_method_calls(source: str) -> list[str]:
    """The ``set_start_method(...)`` calls among a module's top-level statements (those run at import), as source."""
    tree = ast.parse(source)
    found = []
    for statement in tree.body:
        if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(statement):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                if name == "set_start_method":
                    found.append(ast.unparse(node))
    return found


def _spawn_unless_chosen(original: Any) -> Any:
    def __init__(self, config_params, dp_writer_config, optimize_dp_state):
        import torch.multiprocessing as mp

        # PR #7349 in its final upstream form: choose spawn for the checkpoint writer only where nobody chose
        try:
            mp.set_start_method('spawn')
        except RuntimeError:
            pass  # already chosen (by the user): keep it
        original(self, config_params, dp_writer_config, optimize_dp_state)

    __init__.__qualname__ = "DecoupledCheckpointEngine.__init__"
    __init__.__doc__ = original.__doc__
    __init__.__wrapped__ = original
    return __init__


FIX = ImportDeepspeedForcesSpawn()
