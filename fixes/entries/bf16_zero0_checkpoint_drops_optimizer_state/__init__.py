"""Fix for bf16-zero0-checkpoint-drops-optimizer-state: wraps four ``DeepSpeedEngine`` checkpoint methods.

For an engine with bf16, no ZeRO and an optimizer that is not BF16_Optimizer (FP16_Optimizer /
FP16_UnfusedOptimizer, the DDP_BFLOAT16 path), the optimizer state goes where upstream PR #7786 puts it,
the model file:

* ``_save_checkpoint``: adds ``optimizer=self.optimizer.state_dict()`` to the ``client_state`` it
  passes on (the original writes ``state.update(client_state)`` after its own ``optimizer=None``);
* ``_load_checkpoint``: after the original, loads that entry into the optimizer (the original skips it
  because ``has_zero_optimizer_state`` is true for every bf16 engine);
* ``_load_zero_checkpoint``: returns True at once for such an engine: there are no ZeRO files, and the
  caller would otherwise call ``_restore_from_bit16_weights``, which the fp16 optimizers lack
  (0.17.6, upstream issue #7571).

For an engine with bf16, no ZeRO and BF16_Optimizer (what ``bf16-gets-fp16-optimizer`` builds for
``grad_accum_dtype`` fp32), ``load_checkpoint`` reads its ZeRO files after the original where the
installed one reads them only under ZeRO (0.18.0 - 0.18.4, upstream PR #7586), the way 0.17.6 did.
Any other engine goes straight to the original methods. The optimizer choice itself is
``bf16-gets-fp16-optimizer``'s fix, not this one's. The probe reads the
``zero_optimization() or self.bfloat16_enabled()`` test in ``_save_checkpoint`` and the DDP_BFLOAT16
wrapper in the engine module.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_ENGINE = "deepspeed.runtime.engine"
_BF16 = "deepspeed.runtime.bf16_optimizer"
_BF16_TEST = "self.zero_optimization() or self.bfloat16_enabled()"

_SAVE = Target(_ENGINE, "DeepSpeedEngine._save_checkpoint")
_LOAD_FILE = Target(_ENGINE, "DeepSpeedEngine._load_checkpoint")
_LOAD_ZERO = Target(_ENGINE, "DeepSpeedEngine._load_zero_checkpoint")
_LOAD = Target(_ENGINE, "DeepSpeedEngine.load_checkpoint")


class Bf16Zero0CheckpointDropsOptimizerState(Fix):
    targets = (_SAVE, _LOAD_FILE, _LOAD_ZERO, _LOAD)

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE)
        if getattr(engine, "DDP_BFLOAT16", None) is None:
            return Probe(False, "the engine has no DDP_BFLOAT16 wrapper: bf16 without ZeRO always gets "
                                "BF16_Optimizer, which writes a ZeRO optimizer file")
        if _BF16_TEST not in inspect.getsource(engine.DeepSpeedEngine._save_checkpoint):
            return Probe(False, "_save_checkpoint keeps the optimizer state out of the model file only under ZeRO")
        return Probe(True, "_save_checkpoint keeps the optimizer state out of the model file for every bf16 "
                           "engine, and bf16 without ZeRO can get an fp16 optimizer (DDP_BFLOAT16)")

    def patches(self) -> list[AttributePatch]:
        bf16_optimizer = import_target_module(_BF16).BF16_Optimizer
        # Where load_checkpoint itself reads ZeRO files for bf16 without ZeRO (0.17.6), it is left as it is.
        reads_zero_files = _BF16_TEST in inspect.getsource(_LOAD.code())
        patches = [
            _SAVE.wrap(lambda original: _saving_state(original, bf16_optimizer)),
            _LOAD_FILE.wrap(lambda original: _loading_state(original, bf16_optimizer)),
            _LOAD_ZERO.wrap(lambda original: _no_zero_files(original, bf16_optimizer)),
        ]
        if not reads_zero_files:
            patches.append(_LOAD.wrap(lambda original: _loading_bf16_zero_files(original, bf16_optimizer)))
        return patches


def state_in_model_file(engine: Any, bf16_optimizer: type) -> bool:
    """bf16 without ZeRO with an optimizer that writes no ZeRO file (not BF16_Optimizer), no MoE."""
    return (engine.bfloat16_enabled() and not engine.zero_optimization() and engine.optimizer is not None
            and not isinstance(engine.optimizer, bf16_optimizer) and not engine.has_moe_layers)


def _arguments(original: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _saving_state(original: Any, bf16_optimizer: type) -> Any:
    @functools.wraps(original)
    def _save_checkpoint(self, *args, **kwargs):
        if not state_in_model_file(self, bf16_optimizer):
            return original(self, *args, **kwargs)
        arguments = _arguments(original, self, *args, **kwargs)
        # the original writes `state.update(client_state)` after its own `optimizer=None`
        arguments["client_state"] = {**(arguments["client_state"] or {}), "optimizer": self.optimizer.state_dict()}
        return original(**arguments)

    return _save_checkpoint


def _loading_state(original: Any, bf16_optimizer: type) -> Any:
    @functools.wraps(original)
    def _load_checkpoint(self, *args, **kwargs):
        load_path, client_state = original(self, *args, **kwargs)
        arguments = _arguments(original, self, *args, **kwargs)
        if (load_path is not None and state_in_model_file(self, bf16_optimizer)
                and arguments["load_optimizer_states"] and not arguments["load_module_only"]):
            import torch

            saved = self.checkpoint_engine.load(load_path, map_location=torch.device("cpu"))
            if saved.get("optimizer") is not None:  # None in a checkpoint saved without this fix
                self.optimizer.load_state_dict(saved["optimizer"])
        return load_path, client_state

    return _load_checkpoint


def _no_zero_files(original: Any, bf16_optimizer: type) -> Any:
    @functools.wraps(original)
    def _load_zero_checkpoint(self, *args, **kwargs):
        if state_in_model_file(self, bf16_optimizer):
            return True  # no ZeRO files: _load_checkpoint loaded the state from the model file
        return original(self, *args, **kwargs)

    return _load_zero_checkpoint


def _loading_bf16_zero_files(original: Any, bf16_optimizer: type) -> Any:
    @functools.wraps(original)
    def load_checkpoint(self, *args, **kwargs):
        load_path, client_state = original(self, *args, **kwargs)
        arguments = _arguments(original, self, *args, **kwargs)
        if (load_path is not None and self.bfloat16_enabled() and not self.zero_optimization()
                and isinstance(self.optimizer, bf16_optimizer)):
            # what 0.17.6's load_checkpoint does for bf16 without ZeRO
            if arguments["load_optimizer_states"] and not arguments["load_module_only"]:
                tag = os.path.basename(os.path.dirname(load_path))
                loaded = self._load_zero_checkpoint(arguments["load_dir"], tag,
                                                    load_optimizer_states=arguments["load_optimizer_states"])
            else:
                loaded = False
            if not loaded:
                self.optimizer._restore_from_bit16_weights()
        return load_path, client_state

    return load_checkpoint


FIX = Bf16Zero0CheckpointDropsOptimizerState()
