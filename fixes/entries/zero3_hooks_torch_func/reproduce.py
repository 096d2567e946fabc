"""How zero3-hooks-torch-func is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """``torch.func.grad`` of an MSE loss with respect to the input of a 1-rank ZeRO-3 TinyMLP whose
    parameters are partitioned, in a child process (it may die), no fix applied. True if ZeRO-3's
    hooks fail: the setup_context error raised from a ``_post_backward_module_hook`` (before any
    linear layer runs, so the F.linear entry does not matter here), the ``reset_step`` error (up to
    0.17.5), or a crash (SIGSEGV, or functorch's internal level assert: the same corruption caught
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
