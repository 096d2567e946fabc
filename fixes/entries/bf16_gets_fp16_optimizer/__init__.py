"""Fix for bf16-gets-fp16-optimizer: does what upstream PR #7788 does, by attribute swaps only.

The engine module's ``DDP_BFLOAT16`` (and, for consistency, the constants module's) becomes
``"ddp_bf16"``, so it no longer equals ``BFLOAT16`` and ``_configure_optimizer`` sends the
``BFLOAT16`` that ``_do_optimizer_sanity_check`` returns for bf16 + fp32 gradient accumulation to
BF16_Optimizer again. Where ``ZeROOptimizer`` has ``scale_if_loss`` (``engine.backward`` asks every
ZeRO optimizer for it), BF16_Optimizer also gets ``custom_loss_scaler = False``,
``external_loss_scale = None``, ``torch_autocast_gradscaler = None`` and a ``scale_if_loss`` that
returns the loss unscaled (what upstream's base method does for an optimizer without a loss scaler).
An engine built before ``apply()`` keeps the optimizer it built. bf16 *without* fp32 accumulation
keeps the fp16-optimizer path it was designed for (``DDP_BFLOAT16``); that path's own faults
(upstream issue #7837, PR #7839) are not this entry's. The probe reads both constants and the order
of ``_configure_optimizer``'s tests.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_ENGINE = "deepspeed.runtime.engine"
_CONSTANTS = "deepspeed.runtime.constants"
_BF16 = "deepspeed.runtime.bf16_optimizer"
_BASE = "deepspeed.runtime.base_optimizer"
_FIXED_VALUE = "ddp_bf16"  # the value PR #7788 gave DDP_BFLOAT16


class Bf16GetsFp16Optimizer(Fix):
    targets = (
        Target(_ENGINE, "DeepSpeedEngine._configure_optimizer"),
        Target(_ENGINE, "DeepSpeedEngine._do_optimizer_sanity_check"),
        Target(_BF16, "BF16_Optimizer.__init__"),
    )

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE)
        ddp, bf16 = getattr(engine, "DDP_BFLOAT16", None), getattr(engine, "BFLOAT16", None)
        if ddp is None:
            return Probe(False, "the engine has no DDP_BFLOAT16 wrapper (bf16 without ZeRO is not sent to the "
                                "fp16 optimizers)")
        if ddp != bf16:
            return Probe(False, f"DDP_BFLOAT16 = {ddp!r} differs from BFLOAT16 = {bf16!r}")
        source = inspect.getsource(engine.DeepSpeedEngine._configure_optimizer)
        fp16_first = source.find("DDP_BFLOAT16]"), source.find("== BFLOAT16")
        if -1 in fp16_first or fp16_first[0] > fp16_first[1]:
            return Probe(False, "_configure_optimizer tests BFLOAT16 before the fp16/DDP_BFLOAT16 branch")
        return Probe(True, f"DDP_BFLOAT16 and BFLOAT16 are both {bf16!r} and _configure_optimizer tests "
                           "[FP16, DDP_BFLOAT16] first")

    def patches(self) -> list[AttributePatch]:
        patches = [AttributePatch(import_target_module(module), "DDP_BFLOAT16", _FIXED_VALUE)
                   for module in (_ENGINE, _CONSTANTS)]
        base = import_target_module(_BASE)
        bf16_optimizer = import_target_module(_BF16).BF16_Optimizer
        if hasattr(base.ZeROOptimizer, "scale_if_loss"):  # 0.18.3+: engine.backward asks every ZeRO optimizer
            patches += [AttributePatch(bf16_optimizer, name, value) for name, value in _SCALER_ATTRIBUTES.items()]
            patches.append(AttributePatch(bf16_optimizer, "scale_if_loss", _unscaled))
        return patches


# BF16 never scales the loss; 0.18.3's ZeROOptimizer.scale_if_loss/needs_scaler read these (PR #7788 sets them).
_SCALER_ATTRIBUTES: dict[str, Any] = {"custom_loss_scaler": False, "external_loss_scale": None,
                                      "torch_autocast_gradscaler": None}


def _unscaled(self, value):
    """BF16_Optimizer.scale_if_loss: bf16 needs no loss scale (0.18.5's base method returns the value
    when the optimizer has no loss scaler; 0.18.3/0.18.4's calls ``self.loss_scaler``, which it lacks)."""
    return value




FIX = Bf16GetsFp16Optimizer()
