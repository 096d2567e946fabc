"""How zero3-linear-setup-context is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from typing import Any

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


# ---- the trigger's grid --------------------------------------------------------------------------------------------

SETUP_CONTEXT_ERROR = "must override the setup_context staticmethod"


def parameter_grads(job: Any, func: bool = True) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): build ``job``'s engine (inside ``deepspeed.zero.Init`` where
    ``job.zero3_init``), then the gradient of the MSE loss with respect to every parameter, the parameters gathered
    (``fixes.zero3.gathered_parameters``) and the model called through ``fixes.zero3.functional_call`` (ZeRO-3's
    module hooks suspended: the workaround entry zero3-hooks-torch-func documents, so that only ``F.linear`` is in
    the way): with ``torch.func.grad`` (``func``) or with ``torch.autograd.grad``."""
    import torch

    from ...harness import build_engine, device, make_batches, mse
    from ...zero3 import functional_call, gathered_parameters

    engine = build_engine(job)
    model = engine.module
    x, y = (t.to(device()) for t in make_batches(job.model, 1).micro(0, 0, 0))
    with gathered_parameters(model) as params:
        if func:
            return dict(torch.func.grad(lambda p: mse(functional_call(model, p, (x, )), y))(params))
        leaves = {name: p.clone().requires_grad_(True) for name, p in params.items()}
        grads = torch.autograd.grad(mse(functional_call(model, leaves, (x, )), y), list(leaves.values()))
        return {name: grad.detach() for name, grad in zip(leaves, grads)}


def reference_grads(job: Any) -> dict[str, Any]:
    """The same parameter gradients on the plain-PyTorch TinyMLP (PyTorch's own ``F.linear``)."""
    import torch

    from ...harness import TinyMLP, make_batches, mse, original_functional_linear, to_numpy

    with original_functional_linear():
        model = TinyMLP(job.model)
        x, y = make_batches(job.model, 1).micro(0, 0, 0)
        params = {name: p.detach() for name, p in model.named_parameters()}
        return to_numpy(dict(torch.func.grad(lambda p: mse(torch.func.functional_call(model, p, (x, )), y))(params)))


def linear_fails(job: Any, func: bool = True) -> bool:
    """:func:`parameter_grads` in a fresh child rank (``zero.Init`` replaces ``F.linear`` for the rest of the process).
    True if it raises the setup_context error from ``LinearFunctionForZeroStage3`` (``zero3_linear_wrap``); False if
    the gradients match plain PyTorch; any other failure cannot tell."""
    from ...exceptions import CannotTellError, RankFailedError
    from ...harness import compare, launch

    try:
        [grads] = launch(parameter_grads, 1, job, func)
    except RankFailedError as error:
        if SETUP_CONTEXT_ERROR in error.message and ("zero3_linear_wrap" in error.traceback
                                                     or "LinearFunctionForZeroStage3" in error.traceback):
            return True
        raise CannotTellError(f"the gradient failed otherwise: {error.exc_type}: {error.message}"[:300]) from error
    comparison = compare(grads, reference_grads(job), "float32", "parameter gradients")
    if not comparison.close:
        raise CannotTellError(f"the gradients ran but differ from plain PyTorch: {comparison}")
    return False


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): one rank, a ZeRO-3 TinyMLP built inside ``zero.Init``, then
    ``torch.func.grad`` of the loss with respect to the parameters through ``fixes.zero3.functional_call`` (ZeRO-3's
    module hooks out of the way: over the bare module they fail first, entry zero3-hooks-torch-func); then each
    condition flipped on its own: the model built outside ``zero.Init`` (``deepspeed.initialize`` partitions it),
    ``torch.autograd.grad`` instead of ``torch.func.grad``; and ZeRO-2 with the model still built inside
    ``zero.Init``, which fails the same way: the stage does not matter, ``zero.Init`` having run in the process does
    (the trigger has no stage condition). Each cell runs in a fresh child rank."""
    from ...harness import Cell, Job, trigger_job

    base = Job(zero_stage=3, zero3_init=True, steps=1,
               config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    zero2 = base.with_(zero_stage=2, config={"zero_optimization": {"stage": 2}})
    no_init = base.with_(zero3_init=False)
    return [Cell("ZeRO-3, zero.Init, torch.func.grad", trigger_job(base, 1, uses=("zero-init", "torch-func")),
                 lambda: linear_fails(base)),
            Cell("the model built outside zero.Init", trigger_job(no_init, 1, uses=("torch-func",)),
                 lambda: linear_fails(no_init), "uses:zero-init"),
            Cell("torch.autograd.grad instead of torch.func.grad", trigger_job(base, 1, uses=("zero-init",)),
                 lambda: linear_fails(base, func=False), "uses:torch-func"),
            Cell("ZeRO-2 with the model built inside zero.Init",
                 trigger_job(zero2, 1, uses=("zero-init", "torch-func")), lambda: linear_fails(zero2), "zero_stage")]
