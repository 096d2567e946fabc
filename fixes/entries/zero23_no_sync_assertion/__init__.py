"""Fix for zero23-no-sync-assertion: wraps ``DeepSpeedEngine.no_sync``.

Under ZeRO stage 2 or 3 (``zero_optimization_partition_gradients()``) the wrapper returns a context that
does nothing: it does not raise, and it does not set ``inside_no_sync_ctxt``. Setting that flag is what
the assertion protects against: ``engine.backward`` then skips ``allreduce_gradients()`` (for ZeRO-2/3
the flush of the last reduce bucket, ``overlapping_partition_gradients_reduce_epilogue``) and, up to the
engine.backward rewrite, also the 1/gradient_accumulation_steps loss scaling. ZeRO-2/3 reduce and
partition every micro-batch's gradients in their backward hooks anyway and step on the average at the
boundary, so a backward inside the wrapped ``no_sync()`` is exactly a backward outside it: the same
arithmetic as the loop without ``no_sync`` (and as downstream's workaround, transformers #35157 and
accelerate #3656, which skip ``no_sync`` for ZeRO >= 2). ``engine.step()`` inside it is not refused (it
is DeepSpeed's usual step: a no-op off the boundary), and nesting is not refused either, since no
state is kept. Under ZeRO stage 0/1 the original context manager is called, unchanged.

The probe reads the installed ``no_sync`` for the ``zero_optimization_partition_gradients()``
assertion.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_ENGINE = "deepspeed.runtime.engine"
_TARGET = Target(_ENGINE, "DeepSpeedEngine.no_sync")
_ASSERTION = "assert not self.zero_optimization_partition_gradients()"


class Zero23NoSyncAssertion(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE).DeepSpeedEngine
        method = getattr(engine, "no_sync", None)
        if method is None:
            return Probe(False, "DeepSpeedEngine has no no_sync (before PR #6675)")
        source = inspect.getsource(inspect.unwrap(method))
        if _ASSERTION in source:
            return Probe(True, "DeepSpeedEngine.no_sync asserts not zero_optimization_partition_gradients() "
                               "(refuses ZeRO stage 2 and 3)")
        return Probe(False, "DeepSpeedEngine.no_sync does not refuse ZeRO stages that partition gradients")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_no_sync)]


def _no_sync(original: Any) -> Any:
    """``no_sync`` that, under ZeRO stage >= 2, is a context that changes nothing (see the module docstring);
    the original everywhere else."""

    @functools.wraps(original)
    def no_sync(self):
        if self.zero_optimization_partition_gradients():
            # ZeRO-2/3 reduce every micro-batch in backward and average at the boundary: a backward in
            # here must be a plain backward, so inside_no_sync_ctxt stays False
            return contextlib.nullcontext()
        return original(self)

    return no_sync


FIX = Zero23NoSyncAssertion()
