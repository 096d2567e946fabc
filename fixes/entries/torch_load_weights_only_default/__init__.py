"""Fix for torch-load-weights-only-default: what upstream PR #6751 does on the paths of ``engine.load_checkpoint``
and ``zero_to_fp32``, namely pass ``weights_only=False`` to ``torch.load`` explicitly.

From torch 2.6 on, ``torch.load`` without ``weights_only`` loads with ``weights_only=True``: it unpickles tensors,
containers and numbers only. A DeepSpeed checkpoint's optimizer file holds DeepSpeed objects too (the ZeRO
optimizer's ``LossScaler``, ``ZeroStageEnum``; the BF16 optimizer's ``fragment_address``), so every ``torch.load``
DeepSpeed makes without ``weights_only`` fails on it with ``_pickle.UnpicklingError: Weights only load failed``.

Three functions are recompiled from the installed release's own source (:func:`fixes.patching.recompiled`: the
module's globals, the installed file's line numbers, ``__wrapped__`` the original), with ``weights_only=False``
added to each ``torch.load(...)`` call in them that passes no ``weights_only``:

* ``TorchCheckpointEngine.load`` (``deepspeed/runtime/checkpoint_engine/torch_checkpoint_engine.py``): every file
  ``engine.load_checkpoint`` reads (model states, ZeRO and BF16 optimizer files) goes through it;
* ``parse_model_states`` and ``parse_optim_states`` (``deepspeed/utils/zero_to_fp32.py``): the files
  ``convert_zero_checkpoint_to_fp32_state_dict`` / ``get_fp32_state_dict_from_zero_checkpoint`` read.

Not covered (the PR changes them too): the universal-checkpoint code (``ds_to_universal``, ``DeepSpeedCheckpoint``,
``ZeROCheckpoint``, ``load_hp_checkpoint_state`` and the optimizers' ``load_hp_checkpoint_state_from_checkpoint_dir``
that ``"load_universal": true`` uses), the Nebula checkpoint engine, inference checkpoint loading, and the copy of
``zero_to_fp32.py`` that ``save_checkpoint`` leaves in each checkpoint folder (it has its own functions; run the
library's converter after ``fixes.apply`` instead).

The probe asks torch whether ``torch.load`` without ``weights_only`` loads weights only (torch 2.6 or newer, unless
``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set) and reads the three functions' source: affected where one of them
calls ``torch.load`` without a ``weights_only`` keyword.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, recompiled

_LOAD = Target("deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine.load")
_MODEL_STATES = Target("deepspeed.utils.zero_to_fp32", "parse_model_states")
_OPTIM_STATES = Target("deepspeed.utils.zero_to_fp32", "parse_optim_states")
_LABEL = "torch-load-weights-only-default"


def torch_loads_weights_only() -> bool:
    """Whether the installed torch's ``torch.load`` loads with ``weights_only=True`` where the caller passes no
    ``weights_only`` (torch 2.6 or newer, unless ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD`` is set)."""
    import os

    import torch.serialization

    def set_(name: str) -> bool:
        return os.getenv(name, "0").lower() in ("1", "y", "yes", "true")

    if set_("TORCH_FORCE_WEIGHTS_ONLY_LOAD"):
        return True
    if set_("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"):
        return False
    default = getattr(torch.serialization, "_default_to_weights_only", None)  # torch 2.6+: True
    return bool(default(None)) if default is not None else False


def _loads_without_weights_only(tree: ast.AST) -> list[ast.Call]:
    """The ``torch.load(...)`` calls in ``tree`` that pass no ``weights_only``."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "load"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
            and not any(keyword.arg == "weights_only" for keyword in node.keywords)]


def _source(target: Target) -> str:
    return textwrap.dedent(inspect.getsource(target.code()))


def _with_weights_only_false(target: Target) -> str:
    """``target``'s installed source (dedented) with ``, weights_only=False`` added to each ``torch.load`` call that
    passes no ``weights_only``; DriftError (nothing patched) where it has none."""
    source = _source(target)
    calls = _loads_without_weights_only(ast.parse(source))
    if not calls:
        raise DriftError(f"{target.dotted}: no torch.load call without weights_only in its source. Nothing was patched.")
    lines = source.splitlines(True)
    for call in sorted(calls, key=lambda c: (c.end_lineno, c.end_col_offset), reverse=True):
        line = lines[call.end_lineno - 1]
        # end_col_offset counts UTF-8 bytes; the closing parenthesis is the call's last byte
        encoded = line.encode()
        closing = call.end_col_offset - 1
        if encoded[closing:closing + 1] != b")":
            raise DriftError(f"{target.dotted}: cannot find the end of a torch.load call. Nothing was patched.")
        lines[call.end_lineno - 1] = (encoded[:closing] + b", weights_only=False" + encoded[closing:]).decode()
    return "".join(lines)


class TorchLoadWeightsOnlyDefault(Fix):
    targets = (_LOAD, _MODEL_STATES, _OPTIM_STATES)

    def read_code(self) -> Probe:
        import torch

        implicit = [target.qualname for target in self.targets if _loads_without_weights_only(ast.parse(_source(target)))]
        if not implicit:
            return Probe(False, "TorchCheckpointEngine.load, parse_model_states and parse_optim_states pass "
                                "weights_only to torch.load")
        if not torch_loads_weights_only():
            return Probe(False, f"{', '.join(implicit)} call torch.load without weights_only, but this torch "
                                f"({torch.__version__}) then loads with weights_only=False")
        return Probe(True, f"{', '.join(implicit)} call torch.load without weights_only, and this torch "
                           f"({torch.__version__}) then loads with weights_only=True, which refuses the DeepSpeed "
                           "objects a checkpoint's optimizer files hold")

    def patches(self) -> list[AttributePatch]:
        patches = []
        for target in self.targets:
            if _loads_without_weights_only(ast.parse(_source(target))):
                patches.append(target.replace(recompiled(target.code(), _with_weights_only_false(target), _LABEL)))
        return patches


FIX = TorchLoadWeightsOnlyDefault()
