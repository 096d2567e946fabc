"""How zero3-linear-setup-context is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from ...patching import import_target_module
from . import _CLASS, _MODULE


def reproduce() -> bool:
    """``torch.func.grad`` through ``LinearFunctionForZeroStage3`` (what ``zero.Init`` routes
    ``F.linear`` to): the setup_context error, or the plain-PyTorch gradient."""
    import torch

    cls = getattr(import_target_module(_MODULE), _CLASS)
    generator = torch.Generator().manual_seed(0)
    W, x = torch.randn(4, 8, generator=generator), torch.randn(5, 8, generator=generator)
    try:
        grad = torch.func.grad(lambda w: cls.apply(x, w).pow(2).sum())(W)
    except RuntimeError as exc:
        if "setup_context" in str(exc):
            return True
        raise
    expected = torch.func.grad(lambda w: torch.nn.functional.linear(x, w).pow(2).sum())(W)
    torch.testing.assert_close(grad, expected)
    return False


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path:
    every ZeRO-3 forward and backward goes through it)."""
    from ... import harness

    return harness.bench_job(zero_stage=3, zero3_init=True)
