"""Fix for zero3-linear-unbound-dim-bias-only: the backport of upstream PR #7449, a replacement for
``deepspeed.runtime.zero.linear.LinearFunctionForZeroStage3.backward``.

The replacement is the installed ``backward`` with ``dim = grad_output.dim()`` moved out of the weight-gradient
branch to the top, as upstream's fixed ``backward`` (0.17.4 on) has it; every other line is the installed code,
token for token, and it is decorated the same way (the module's ``autocast_custom_bwd``), so every gradient that
worked before is computed as before. ``__wrapped__`` names the installed ``backward``: a probe or a drift check
that reads the code under the class attribute (this entry's, zero3-linear-setup-context's) reads DeepSpeed's code.

The probe reads the code under ``LinearFunctionForZeroStage3.backward``: affected where every assignment to
``dim`` sits inside ``if ctx.needs_input_grad[1]:`` (the weight's gradient) while ``dim`` is read outside it
(the bias's gradient).

Composition with zero3-linear-setup-context, which replaces the same ``backward`` (with upstream's later
rewrite, whose ``backward`` computes ``dim`` first): where that fix is applied, this probe reads its
``backward`` and says not affected, so ``apply()`` patches nothing. Applied the other way round, that fix's
drift check reads the installed code under this fix's ``__wrapped__`` and accepts it, and its ``backward``
replaces this one; ``fixes.revert()`` takes them off in the reverse order of applying and restores DeepSpeed's
own ``backward``, and reverting this fix alone while that one is applied over it is refused (``PatchError``:
revert that one first). ``fixes.apply()`` with no ids applies that fix first (it is required by
zero3-hooks-torch-func, and its id sorts first), so this one is then not needed.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.linear"
_TARGET = Target(_MODULE, "LinearFunctionForZeroStage3.backward")


class Zero3LinearUnboundDimBiasOnly(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        source = textwrap.dedent(inspect.getsource(_TARGET.code()))
        found = _dim_only_in_weight_branch(ast.parse(source))
        if found:
            return Probe(True, f"LinearFunctionForZeroStage3.backward assigns dim only inside "
                               f"`if ctx.needs_input_grad[1]:` and reads it outside, in {found}")
        return Probe(False, "LinearFunctionForZeroStage3.backward assigns dim wherever it reads it")

    def patches(self) -> list[AttributePatch]:
        module = import_target_module(_MODULE)
        return [_TARGET.wrap(functools.partial(_dim_first, module.autocast_custom_bwd))]


def _needs_input_grad(test: ast.AST, index: int) -> bool:
    """Whether ``test`` reads ``ctx.needs_input_grad[index]``."""
    return any(isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
               and node.value.attr == "needs_input_grad" and isinstance(node.slice, ast.Constant)
               and node.slice.value == index for node in ast.walk(test))


def _dim_only_in_weight_branch(tree: ast.AST) -> str:
    """Where ``dim`` is read outside the ``if ctx.needs_input_grad[1]:`` blocks that hold every assignment to it:
    the outermost such ``if`` (its test, as source), or "" where every read of ``dim`` follows an assignment."""
    weight_ifs = [node for node in ast.walk(tree) if isinstance(node, ast.If) and _needs_input_grad(node.test, 1)]
    inside = {id(inner) for branch in weight_ifs for inner in ast.walk(branch)}
    names = [node for node in ast.walk(tree) if isinstance(node, ast.Name) and node.id == "dim"]
    if not names or any(isinstance(node.ctx, ast.Store) and id(node) not in inside for node in names):
        return ""
    outside = {id(node) for node in names if id(node) not in inside}
    for node in ast.walk(tree):  # breadth first: the outermost if comes first
        if isinstance(node, ast.If) and id(node) not in inside and any(id(n) in outside for n in ast.walk(node)):
            return f"`if {ast.unparse(node.test)}:`"
    return "backward's body" if outside else ""


def _dim_first(autocast_custom_bwd: Any, original: Any) -> Any:
    """``backward`` as upstream fixed it (PR #7449): ``dim`` assigned before either branch reads it."""
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        dim = grad_output.dim()  # upstream PR #7449: before the branches, not inside the weight's
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
        if ctx.needs_input_grad[1]:
            if dim > 2:
                grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                    input.reshape(-1, input.shape[-1]))
            else:
                grad_weight = grad_output.t().matmul(input)
        if bias is not None and ctx.needs_input_grad[2]:
            if dim > 2:
                grad_bias = grad_output.sum([i for i in range(dim - 1)])
            else:
                grad_bias = grad_output.sum(0)
        return grad_input, grad_weight, grad_bias

    installed = original.__func__ if isinstance(original, staticmethod) else original
    fixed = functools.update_wrapper(autocast_custom_bwd(backward), installed)  # __wrapped__: the installed code
    return staticmethod(fixed)


FIX = Zero3LinearUnboundDimBiasOnly()
