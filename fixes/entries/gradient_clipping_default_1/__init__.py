"""A behaviour change, not a bug: ``gradient_clipping`` defaults to 1.0, so a config that never sets it clips.

Upstream PR #8068 changed ``GRADIENT_CLIPPING_DEFAULT`` in ``deepspeed/runtime/constants.py`` from ``0.``
(no clipping) to ``1.0``. ``deepspeed/runtime/config.py`` copies the constant into its own namespace at
import time (``from .constants import *``), and ``get_gradient_clipping(param_dict)`` reads that copy when
``DeepSpeedConfig`` parses the user's config; the engine's ``gradient_clipping()`` returns the result and
every optimizer path (the engine's fp32 step, ZeRO-1/2/3, bf16, fp16) clips to it when it is above 0.

The "fix" pins the old behaviour explicitly: it wraps ``get_gradient_clipping`` so that a config without a
``gradient_clipping`` key gets ``0.0`` (no clipping), and a config that sets the key, to any value, gets
that value through the original function. Patching the constant would not do it: ``config.py`` holds its
own copy. Apply it before ``deepspeed.initialize``: the config is read there. ``fixes.apply()`` with no
ids never applies it (an intended upstream change); name it to pin the old default.

The probe calls the installed ``get_gradient_clipping`` (never this fix's wrapper) with an empty config:
affected ("has the new default") when it returns a value above 0.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.config", "get_gradient_clipping")
_KEY = "gradient_clipping"  # deepspeed.runtime.constants.GRADIENT_CLIPPING
OLD_DEFAULT = 0.0  # GRADIENT_CLIPPING_DEFAULT before PR #8068: clipping disabled


class GradientClippingDefault1(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        original = inspect.unwrap(_TARGET.raw())
        default = original({})
        constant = original.__globals__.get("GRADIENT_CLIPPING_DEFAULT", "<absent>")
        where = (f"deepspeed.runtime.config.get_gradient_clipping({{}}) returns {default!r} "
                 f"(deepspeed.runtime.config.GRADIENT_CLIPPING_DEFAULT = {constant!r})")
        if default:
            return Probe(True, f"{where}: a config without gradient_clipping clips the gradient norm to {default!r}")
        return Probe(False, f"{where}: a config without gradient_clipping does not clip")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_old_default)]


def _old_default(original: Any) -> Any:
    @functools.wraps(original)
    def get_gradient_clipping(param_dict):
        # The key absent: the default before PR #8068 (no clipping). Present: what the user set, as read
        # by the original (0.0 included).
        if _KEY not in param_dict:
            return OLD_DEFAULT
        return original(param_dict)

    return get_gradient_clipping


FIX = GradientClippingDefault1()
