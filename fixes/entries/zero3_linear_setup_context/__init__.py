"""ZeRO-3's ``LinearFunctionForZeroStage3`` lacks ``setup_context``: torch.func transforms crash.

``deepspeed.zero.Init`` (with the default ``memory_efficient_linear``) replaces
``torch.nn.functional.linear`` process-wide with ``zero3_linear_wrap``, which calls
``LinearFunctionForZeroStage3.apply``. That autograd.Function uses the legacy
``forward(ctx, ...)`` pattern, and PyTorch refuses such functions under any functorch transform.

The fix backports upstream's rewrite (PR #7916, with ``generate_vmap_rule`` from PR #8023; the 1-D
branch of ``backward`` comes from a later upstream release and makes per-sample gradients under
``vmap`` correct): ``forward`` without ``ctx``, ``setup_context`` that saves the tensors and the
autocast state, a ``backward`` that runs under that autocast state, and ``generate_vmap_rule = True``.

The replacement ``backward`` is the same on every release and computes ``dim`` first. Releases whose
``backward`` computes ``dim`` inside the weight-gradient branch (the older of the two fingerprints)
raise UnboundLocalError for a bias gradient without a weight gradient; the replacement fixes that too.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.linear"
_CLASS = "LinearFunctionForZeroStage3"


class Zero3LinearSetupContext(Fix):
    targets = (
        Target(_MODULE, f"{_CLASS}.forward"),
        Target(_MODULE, f"{_CLASS}.backward"),
    )

    def read_code(self) -> Probe:
        import torch

        cls = getattr(import_target_module(_MODULE), _CLASS)
        has_setup_context = cls.setup_context is not torch.autograd.Function.setup_context
        first_param = next(iter(inspect.signature(cls.forward).parameters), None)
        if has_setup_context:
            return Probe(False, f"{_CLASS} defines setup_context")
        return Probe(True, f"{_CLASS}.forward({first_param}, ...) and no setup_context")

    def patches(self) -> list[AttributePatch]:
        import torch

        if not hasattr(torch, "get_autocast_dtype"):  # torch 2.3 and older: the setup_context below could not run
            raise DriftError(f"torch {torch.__version__} has no torch.get_autocast_dtype (torch 2.4 on), which the "
                             "setup_context this fix adds reads: nothing was patched")
        cls = getattr(import_target_module(_MODULE), _CLASS)
        forward, setup_context, backward = _functions()
        return [
            AttributePatch(cls, "forward", staticmethod(forward)),
            AttributePatch(cls, "setup_context", staticmethod(setup_context)),
            AttributePatch(cls, "backward", staticmethod(backward)),
            AttributePatch(cls, "generate_vmap_rule", True),
        ]


def _functions() -> tuple[Any, Any, Any]:
    """The replacement staticmethods, built lazily so importing this module stays cheap."""
    import torch
    from deepspeed.accelerator import get_accelerator

    def forward(input, weight, bias=None):
        if input.dim() == 2 and bias is not None:
            return torch.addmm(bias, input, weight.t())  # fused op is marginally faster
        output = input.matmul(weight.t())
        if bias is not None:
            output += bias
        return output

    def setup_context(ctx, inputs, output):
        # What @custom_fwd recorded on ctx in the legacy forward, so backward can match it.
        device_type = get_accelerator().device_name()
        ctx._dtype = torch.get_autocast_dtype(device_type)
        ctx._fwd_used_autocast = torch.is_autocast_enabled(device_type)
        input, weight, bias = inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None
        ctx.save_for_backward(input, weight, bias)

    def backward(ctx, grad_output):
        # @custom_bwd semantics: backward runs under forward's autocast state, explicitly disabled
        # when forward did not use autocast.
        device_type = get_accelerator().device_name()
        with torch.autocast(device_type=device_type, enabled=ctx._fwd_used_autocast, dtype=ctx._dtype):
            input, weight, bias = ctx.saved_tensors
            grad_input = grad_weight = grad_bias = None
            dim = grad_output.dim()
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                if dim > 2:
                    grad_weight = grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(
                        input.reshape(-1, input.shape[-1]))
                elif dim == 1:  # one sample under vmap
                    grad_weight = grad_output.unsqueeze(-1) * input.unsqueeze(0)
                else:
                    grad_weight = grad_output.t().matmul(input)
            if bias is not None and ctx.needs_input_grad[2]:
                if dim > 2:
                    grad_bias = grad_output.sum([i for i in range(dim - 1)])
                elif dim == 1:
                    grad_bias = grad_output
                else:
                    grad_bias = grad_output.sum(0)
            return grad_input, grad_weight, grad_bias

    return forward, setup_context, backward


FIX = Zero3LinearSetupContext()
