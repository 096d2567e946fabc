"""How zero3-hooks-torch-func is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. ``user_script()`` is the user's script the notebook runs in a child rank (it may die)."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """``torch.func.grad`` of an MSE loss with respect to the input of a 1-rank ZeRO-3 TinyMLP whose
    parameters are partitioned, in a child process (it may die), no fix applied. True if ZeRO-3's
    hooks fail: the setup_context error raised from a ``_post_backward_module_hook`` (before any
    linear layer runs, so the F.linear entry does not matter here), the ``reset_step`` error (where
    it reads a tensor made inside the transform), or a crash (SIGSEGV, or functorch's internal level assert: the same corruption caught
    earlier). False if it runs and matches plain PyTorch; any other failure raises."""
    from ...harness import compare
    from .func_transforms import FuncCase, reference_transforms, run_case_in_child, zero3_func_job

    case = FuncCase(zero3_func_job(steps=1), transforms=("grad", ))
    outcome = run_case_in_child(case)
    if outcome.failed:
        trace = outcome.error.traceback if outcome.error else ""
        if outcome.symptom == "setup_context error" and ("_backward_module_hook" not in trace
                                                         or "zero3_linear_wrap" in trace):
            raise CannotTellError(f"the setup_context error came from elsewhere: {outcome.failing_frame}")
        if outcome.symptom is None:
            raise CannotTellError(f"the whole-model torch.func check failed for another reason: {outcome.error_line}")
        return True
    expected = reference_transforms(case)[0]
    comparison = compare(outcome.results[0]["grad"], expected["grad"], "float32", "input gradient")
    if not comparison.close:
        raise CannotTellError(f"torch.func.grad ran but differs from plain PyTorch: {comparison}")
    return False


def user_script(config: dict[str, Any], x: Any, y: Any) -> dict[str, Any]:
    """A user's script, run in a child rank because it may kill the process: the F.linear fix
    applied (entry ``zero3-linear-setup-context``), the model built inside ``deepspeed.zero.Init``,
    ``deepspeed.initialize`` with ``config``, then ``torch.func.grad`` of the MSE loss with respect
    to the input ``x``, through ``engine.module`` (its parameters partitioned). Returns the gradient."""
    import deepspeed
    import torch

    import fixes

    from ...harness import TinyMLP, device, mse

    fixes.apply("zero3-linear-setup-context")  # the F.linear fix: a no-op where DeepSpeed already has it
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TinyMLP()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    x, y = x.to(device()), y.to(device())
    grad = torch.func.grad(lambda inputs: mse(engine.module(inputs), y))(x)  # fails in ZeRO-3's hooks
    return {"grad": grad}


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path:
    every ZeRO-3 forward and backward goes through it)."""
    from ... import harness

    return harness.bench_job(zero_stage=3, zero3_init=True)


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def torch_func_fails(job: Any) -> bool:
    """:func:`reproduce` for any one-rank ``job``: ``torch.func.grad`` of the MSE loss with respect to the input,
    through ``engine.module``, in a child rank. True where ZeRO-3's hooks fail (the setup_context error from a
    backward module hook, the ``reset_step`` error, a crash or functorch's level assert); False where it runs and
    matches plain PyTorch."""
    from ...harness import compare
    from .func_transforms import SYMPTOMS, FuncCase, reference_transforms, run_case_in_child

    case = FuncCase(job, transforms=("grad", ))
    outcome = run_case_in_child(case)
    if outcome.failed:
        trace = outcome.error.traceback if outcome.error else ""
        if outcome.symptom == "setup_context error" and ("_backward_module_hook" not in trace
                                                         or "zero3_linear_wrap" in trace):
            raise CannotTellError(f"the setup_context error came from elsewhere: {outcome.failing_frame}")
        if outcome.symptom not in SYMPTOMS:
            raise CannotTellError(f"torch.func.grad failed for another reason: {outcome.error_line}")
        return True
    comparison = compare(outcome.results[0]["grad"], reference_transforms(case)[0]["grad"], "float32", "input gradient")
    if not comparison.close:
        raise CannotTellError(f"torch.func.grad ran but differs from plain PyTorch: {comparison}")
    return False


def engine_input_grad(job: Any) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): the same input gradient without ``torch.func``: the input
    requires grad, ``engine.backward`` of the MSE loss of ``engine(x)``, then ``x.grad``."""
    import os

    from ...harness import build_engine, device, mse
    from .func_transforms import rank_inputs

    engine = build_engine(job)
    x, y = (t.to(device()) for t in rank_inputs(job, int(os.environ.get("WORLD_SIZE", "1")),
                                                  int(os.environ.get("RANK", "0"))))
    x.requires_grad_(True)
    engine.backward(mse(engine(x), y))
    return {"grad": x.grad.detach()}


def engine_backward_differs(job: Any) -> bool:
    """:func:`engine_input_grad` in a child rank against plain PyTorch's ``torch.func.grad``; True if it differs."""
    from ...harness import compare, launch
    from .func_transforms import FuncCase, reference_transforms

    [result] = launch(engine_input_grad, 1, job)
    expected = reference_transforms(FuncCase(job, transforms=("grad", )))[0]["grad"]
    return not compare(result["grad"], expected, "float32", "input gradient").close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's check (``torch.func.grad`` with respect to the input
    of a one-rank ZeRO-3 TinyMLP built inside ``zero.Init``, its parameters partitioned, in a child rank), then
    ZeRO-2 instead (the model built plainly: ``zero.Init`` is ZeRO-3's), and the same input gradient without
    ``torch.func`` (``engine.backward``, then ``x.grad``) against plain PyTorch."""
    from ...harness import Cell, trigger_job
    from .func_transforms import zero3_func_job

    base = zero3_func_job(steps=1)
    zero2 = base.with_(zero_stage=2, zero3_init=False, config={"zero_optimization": {"stage": 2}})
    return [Cell("ZeRO-3, torch.func.grad over the model", trigger_job(base, 1, uses=("torch-func",)),
                 lambda: torch_func_fails(base)),
            Cell("ZeRO-2 instead", trigger_job(zero2, 1, uses=("torch-func",)), lambda: torch_func_fails(zero2),
                 "zero_stage"),
            Cell("engine.backward instead of torch.func.grad", trigger_job(base, 1),
                 lambda: engine_backward_differs(base), "uses:torch-func")]
