"""ZeRO-3's own module hooks break ``torch.func`` over a whole model; the fix keeps their parameter
gather out of the transform and makes their autograd.Functions torch.func-ready.

Calling ``torch.func.grad`` (or ``grad_and_value``, ``jacrev``, ``vmap`` over ``grad``) on a function
that runs a ZeRO-3 model with its parameters partitioned goes through ZeRO-3's module hooks
(``deepspeed/runtime/zero/parameter_offload.py``, ``DeepSpeedZeRoOffload._register_deepspeed_module``):

1. Where the per-module hook classes ``PreBackwardFunctionForModule`` and
   ``PostBackwardFunctionModule`` are legacy ``autograd.Function``s (``forward(ctx, ...)``, no
   ``setup_context``), the root module's forward pre-hook raises PyTorch's "must override the
   setup_context staticmethod" error, before any linear layer runs (so ``zero3-linear-setup-context``
   does not help). Upstream converted both in PR #7916, without a vmap rule.
2. In every release the hooks gather (``pre_sub_module_forward_function``/``..._backward_function``)
   and release (``post_sub_module_...``) the parameters *inside* the transform, ending in
   ``param.data = <tensor made under the transform>``. That tensor is a functorch
   ``GradTrackingTensor``; assigning it to ``.data`` turns the plain parameter into a broken wrapper
   (``torch._C._functorch.is_gradtrackingtensor(param)`` becomes True) and the next op that unwraps
   it reads garbage: SIGSEGV, or functorch's "level <= current_level INTERNAL ASSERT FAILED ...
   escaped?" (PyTorch issue #184876 shows the same without DeepSpeed). Where the hook classes are
   new-style, this is what users see.
3. Where ``PartitionedParameterCoordinator.reset_step`` (the root module's pre-hook) calls ``.numpy()``
   on the broadcast module order, made inside the transform, it fails first: "Cannot access data
   pointer of Tensor that doesn't have storage".

The fix (every target fingerprinted; it needs ``zero3-linear-setup-context``):

* wraps ``DeepSpeedZeRoOffload.{pre,post}_sub_module_{forward,backward}_function`` and
  ``PartitionedParameterCoordinator.reset_step`` so that, while a functorch transform is active, they
  run under ``torch._C._DisableFuncTorch()`` -- the guard PyTorch's own FSDP2 puts around its
  unshard/reshard (``_disable_functorch_if_active`` in ``torch/distributed/fsdp/_fully_shard/
  _fsdp_common.py``): gathered and released parameters stay plain tensors. Outside a transform
  nothing changes;
* wraps ``_register_deepspeed_module`` so that right after registration each module's hook classes
  are made torch.func-ready: a legacy class is replaced by a new-style one (``forward`` without
  ``ctx`` plus ``setup_context``, the split upstream made in PR #7916) calling the same captured
  callbacks; every hook class gets ``generate_vmap_rule = True`` (its forward is a ``detach()``), so
  ``vmap`` over ``grad`` works too. Apply the fix before ``deepspeed.initialize`` (the classes are made
  when the engine registers its modules); ``revert()`` restores every patched attribute, while modules
  registered in between keep their converted classes (identical under ordinary autograd).

Where the post-backward hook resets ``ds_grads_remaining`` only once, not at every forward, there is
no fix (no fingerprint is recorded for that code, so apply() refuses): with the hook classes
converted, torch.func gives the right numbers there, but the parameters stay gathered after the
transform and a later ``GatheredParameters`` fails in ``free_param``.

Gradients with respect to the *parameters* need more than a patch: ``torch.func.functional_call``
substitutes plain tensors for ZeRO-3's parameters, and ZeRO-3's hooks cannot fetch those
("'Tensor' object has no attribute 'ds_status'"). :func:`fixes.zero3.gathered_parameters` and
:func:`fixes.zero3.functional_call` are the documented workaround: gather the full parameters outside the
transform, and run the module with ZeRO-3's module hooks suspended. They work without this patch
(with ``zero3-linear-setup-context`` applied where DeepSpeed needs it).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.parameter_offload"
_CLASS = "DeepSpeedZeRoOffload"
_REGISTER = "_register_deepspeed_module"
_COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"
_COORDINATOR = "PartitionedParameterCoordinator"
# (module, class, method): everything ZeRO-3's module hooks call that touches tensors. The four
# DeepSpeedZeRoOffload methods gather/release parameters; reset_step (the root module's forward
# pre-hook) broadcasts the recorded module order, which fails inside a transform where it calls
# .numpy() on the broadcast tensor ("Cannot access data pointer of Tensor that doesn't have storage").
_GUARDED = tuple((_MODULE, _CLASS, name) for name in (
    "pre_sub_module_forward_function", "post_sub_module_forward_function",
    "pre_sub_module_backward_function", "post_sub_module_backward_function")) + (
    (_COORDINATOR_MODULE, _COORDINATOR, "reset_step"), )
_HOOK_CLASSES = ("PreBackwardFunctionForModule", "PostBackwardFunctionModule")



class Zero3HooksTorchFunc(Fix):
    requires = ("zero3-linear-setup-context",)
    targets = ()  # filled below

    def read_code(self) -> Probe:
        cls = _offload_class()
        unguarded = [f"{owner.__name__}.{name}" for owner, name in _guarded_owners()
                     if not _is_guarded(vars(owner).get(name))]
        problems = _hook_class_problems(cls)
        if not unguarded and not problems:
            return Probe(False, "ZeRO-3's hooks gather parameters outside functorch transforms and its hook "
                                "classes define setup_context and a vmap rule")
        found = list(problems)
        if unguarded:
            found.append(f"{', '.join(unguarded)} run tensor code (parameter gather/release) inside functorch "
                         "transforms: param.data = <GradTrackingTensor>")
        return Probe(True, "; ".join(found))

    def patches(self) -> list[AttributePatch]:
        cls = _offload_class()
        patches = [AttributePatch(owner, name, _functorch_guarded(vars(owner)[name]))
                   for owner, name in _guarded_owners() if not _is_guarded(vars(owner)[name])]
        if _hook_class_problems(cls):
            patches.append(AttributePatch(cls, _REGISTER, _converting_hook_classes(vars(cls)[_REGISTER])))
        return patches


# ---- probe helpers --------------------------------------------------------------------------------

def _offload_class() -> Any:
    return getattr(import_target_module(_MODULE), _CLASS)


def _guarded_owners() -> list[tuple[Any, str]]:
    return [(getattr(import_target_module(module), cls), name) for module, cls, name in _GUARDED]


def _is_guarded(method: Any) -> bool:
    """Patched by this fix, or (a future upstream fix) disables functorch itself."""
    if method is None:
        return False
    try:
        source = inspect.getsource(inspect.unwrap(method))
    except (OSError, TypeError):
        return False
    return "_DisableFuncTorch" in source


def _hook_class_problems(cls: Any) -> list[str]:
    """What keeps ZeRO-3's per-module hook classes (as written in the installed source) from
    torch.func: ``"<Class>: legacy forward(ctx, ...)"`` or ``"<Class>: no vmap rule"``; nothing once
    this fix's converter is in place."""
    from .autograd_audit import audit_file

    problems = []
    for found in audit_file(inspect.getsourcefile(cls)):
        if found.name in _HOOK_CLASSES:
            if found.legacy:
                problems.append(f"{found.name}: legacy forward(ctx, ...) without setup_context")
            elif not found.has_vmap_rule:
                problems.append(f"{found.name}: no vmap rule")
    return problems


# ---- the patch -------------------------------------------------------------------------------------

def _functorch_active() -> bool:
    import torch

    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    if active is not None:
        return bool(active())
    return torch._C._functorch.peek_interpreter_stack() is not None


def _functorch_guarded(method: Any) -> Any:
    """``method`` run with functorch disabled when a transform is active (FSDP2's guard), unchanged
    otherwise. Tensors made inside (gathered parameters, released placeholders) are then plain, so
    ``param.data = ...`` never receives a functorch wrapper."""
    import torch

    @functools.wraps(method)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _functorch_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return guarded


def _converting_hook_classes(register: Any) -> Any:
    """``_register_deepspeed_module`` followed by replacing the module's legacy hook classes with
    new-style ones. The original recurses through ``self._register_deepspeed_module``, so every
    submodule passes through this wrapper too."""

    @functools.wraps(register)
    def _register_deepspeed_module(self: Any, module: Any, *args: Any, **kwargs: Any) -> Any:
        result = register(self, module, *args, **kwargs)
        convert_hook_classes(module)
        return result

    return _register_deepspeed_module


def convert_hook_classes(module: Any) -> list[str]:
    """Make ``module.pre_bwd_fn``/``module.post_bwd_fn`` usable under torch.func: a legacy class is
    replaced by a new-style one that captures the same module and callbacks; a new-style class
    without a vmap rule gets ``generate_vmap_rule = True`` (its forward is ``detach()``). Returns
    what was changed, e.g. ``["pre_bwd_fn: new-style", "post_bwd_fn: vmap rule"]``."""
    changed = []
    for attribute, make, callback in (("pre_bwd_fn", _pre_backward_function, "_run_before_backward_function"),
                                      ("post_bwd_fn", _post_backward_function, "_run_after_backward_function")):
        hook_class = module.__dict__.get(attribute)
        if hook_class is None:
            continue
        if not _has_setup_context(hook_class):
            captured = inspect.getclosurevars(hook_class.forward).nonlocals
            setattr(module, attribute, make(captured["module"], captured[callback]))
            changed.append(f"{attribute}: new-style")
        elif not _has_vmap_rule(hook_class):
            hook_class.generate_vmap_rule = True
            changed.append(f"{attribute}: vmap rule")
    return changed


def _has_vmap_rule(function_class: Any) -> bool:
    import torch

    return bool(getattr(function_class, "generate_vmap_rule", False)) or \
        function_class.vmap is not torch.autograd.Function.vmap


def _has_setup_context(function_class: Any) -> bool:
    import torch

    return function_class.setup_context is not torch.autograd.Function.setup_context


def _pre_backward_function(module: Any, run_before_backward: Any) -> Any:
    """DeepSpeed's PreBackwardFunctionForModule with forward/setup_context split (as in PR #7916);
    the bookkeeping is the installed release's (``hasattr``)."""
    import torch

    class PreBackwardFunctionForModule(torch.autograd.Function):
        generate_vmap_rule = True  # forward is detach(): vmap of it is detach() of the batch

        @staticmethod
        def forward(outputs):
            return outputs.detach()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.module = module
            ctx.pre_backward_function = run_before_backward
            if not hasattr(ctx.module, "applied_pre_backward_ref_cnt"):
                ctx.module.applied_pre_backward_ref_cnt = 0
            ctx.module.applied_pre_backward_ref_cnt += 1

        @staticmethod
        def backward(ctx, *args):
            ctx.pre_backward_function(ctx.module)
            return args

    return PreBackwardFunctionForModule


def _post_backward_function(module: Any, run_after_backward: Any) -> Any:
    """DeepSpeed's PostBackwardFunctionModule with forward/setup_context split (as in PR #7916)."""
    import torch

    class PostBackwardFunctionModule(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(output):
            return output.detach()

        @staticmethod
        def setup_context(ctx, inputs, output):
            (output_in, ) = inputs
            ctx.module = module
            if output_in.requires_grad:
                module.ds_grads_remaining += 1
                ctx.post_backward_function = run_after_backward

        @staticmethod
        def backward(ctx, *args):
            ctx.module.ds_grads_remaining = ctx.module.ds_grads_remaining - 1
            if ctx.module.ds_grads_remaining == 0:
                ctx.post_backward_function(ctx.module)
            return args

    return PostBackwardFunctionModule


def _targets() -> tuple[Target, ...]:
    return tuple(Target(module, f"{cls}.{name}")
                 for module, cls, name in (*_GUARDED, (_MODULE, _CLASS, _REGISTER)))


Zero3HooksTorchFunc.targets = _targets()
FIX = Zero3HooksTorchFunc()
