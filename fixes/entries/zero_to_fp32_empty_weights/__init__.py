"""Fix for zero-to-fp32-empty-weights: wraps ``deepspeed.utils.zero_to_fp32.to_torch_tensor``.

The wrapper hands the original a shallow copy of the dict it is given, so the original's in-place
writes (``torch.empty`` placeholders for the shard plan, or the materialised tensors) land in the copy
it returns, and the caller's dict of lazy tensors stays as it was. That is upstream PR #6792's change
(build and return a new dict) with the original's code kept: shared tensors are still resolved
through the dict being built, as upstream does. ``convert_zero_checkpoint_to_fp32_state_dict`` looks
``to_torch_tensor`` up in the module at call time, so patching the module attribute fixes the library
function; it cannot fix the copy of the script ``engine.save_checkpoint`` left in a checkpoint folder
(that file has its own ``to_torch_tensor``).

The probe reads ``to_torch_tensor``'s source: affected when it assigns into the dict it was given
(its first parameter) and the module calls it with ``return_empty_tensor=True`` before saving.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_TARGET = Target("deepspeed.utils.zero_to_fp32", "to_torch_tensor")


class ZeroToFp32EmptyWeights(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        module = import_target_module(_TARGET.module)
        function = inspect.unwrap(_TARGET.raw())
        if not _writes_into_argument(function):
            return Probe(False, "to_torch_tensor builds and returns a new dict; the dict it is given is left as it is")
        if "return_empty_tensor=True" not in inspect.getsource(module):
            return Probe(False, "to_torch_tensor writes into its argument, but nothing asks it for empty tensors")
        return Probe(True, "to_torch_tensor writes into the dict it is given, and "
                     "to_torch_tensor(state_dict, return_empty_tensor=True) replaces the tensors to be saved "
                     "by torch.empty")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_on_a_copy)]


def _writes_into_argument(function: Any) -> bool:
    """Whether ``function`` assigns ``arg[...] = ...`` to its first parameter."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    definition = tree.body[0]
    if not isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef)) or not definition.args.args:
        return False
    argument = definition.args.args[0].arg
    return any(isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name) and target.value.id == argument
               for node in ast.walk(definition) if isinstance(node, ast.Assign) for target in node.targets)


def _on_a_copy(original: Any) -> Any:
    @functools.wraps(original)
    def to_torch_tensor(state_dict, *args, **kwargs):
        # The original writes into the dict it gets and returns it: give it a copy, so the caller's
        # dict (the lazy tensors the save loop reads later) is never replaced by torch.empty.
        return original(dict(state_dict), *args, **kwargs)

    return to_torch_tensor


FIX = ZeroToFp32EmptyWeights()
