"""Fix for engine-tensor-backward: backports PR #7665's PyTorch-compatible backward (``loss.backward()`` /
``out.backward(grad)`` on an engine's outputs) to releases whose ``DeepSpeedEngine.forward`` hooks nothing
on its outputs.

``forward`` is wrapped to register a gradient hook on every output tensor. In a backward pass that is
not ``engine.backward``'s own (that one is marked by a wrapper around ``engine.backward`` and left exactly
as it is), the first hook to fire runs the release's prologue (timers, the boundary flag, the optimizer's
pre-backward step) and queues the epilogue with ``Variable._execution_engine.queue_callback``, which
PyTorch runs once the whole backward pass is over; every output gradient is divided by gas as the loss
would have been. So the prologue and the epilogue run exactly once per backward pass, whatever the number
of outputs or engines.

Where ``engine.backward`` is written out inline (no ``_backward_prologue``/``_do_optimizer_backward``/
``_backward_epilogue``) and ZeRO-1/2's ``backward`` likewise (no ``backward_prologue``/``backward_epilogue``),
the drift check pins the inline ``backward`` methods instead of the split-off ones (which must then all be
absent), and the hooks run the same steps re-created from that inline code: the engine's all-reduce
epilogue, ZeRO-1/2's micro-step count and contiguous-gradient buffers before the first gradient and its
``fill_grad_accum_attribute`` after the pass. ``engine.backward`` itself stays untouched on every release.

What the optimizer's ``backward`` does is mirrored per optimizer class and release (the drift check pins
each). Where the loss must be scaled before autograd starts (fp16, a torch-autocast GradScaler, the fp16
wrapper that some releases also use for bf16 without ZeRO), or a feature this backport does not cover is
on (Apex AMP, eigenvalue, DeepCompile, ZenFlow, NVMe optimizer swapping), a direct backward raises a
RuntimeError that says to call ``engine.backward(loss)`` (or, where only the loss scale is missing,
``engine.scale(loss).backward()``, see below), before any gradient is accumulated. Upstream's version
refuses a direct backward without ZeRO and, unless ``engine.scale(loss)`` was used, where a loss scale is
needed; this backport is more permissive without ZeRO: with the client's fp32 optimizer, where the direct
backward already gives correct results on one rank with gas=1 and so must not start failing, and with the
fp16 wrappers after ``engine.scale(loss)``, where it equals ``engine.backward``.

The same PR gave users ``engine.scale(loss)`` (the loss scaled by the optimizer's loss scaler, for
``engine.scale(loss).backward()``) and the ZeRO optimizers' ``needs_scaler()``/``scale_if_loss()``. The fix
adds them where missing, following upstream's contract: ``scale`` asserts an optimizer (not DummyOptim) and
a scalar loss with a ``grad_fn`` (AssertionError), raises RuntimeError under Apex AMP, scales through the
ZeRO optimizer's ``scale_if_loss`` or ZeRO-0's torch.autocast GradScaler, does not divide by gas (the
output hooks do) and marks the engine so that the next direct backward is not refused for its loss scale.
Where the scale is applied it is the one the release's own ``optimizer.backward`` applies (``loss.float() *
loss_scale``, the custom loss scale, the GradScaler), so ``engine.scale(loss).backward()`` equals
``engine.backward(loss)`` bit for bit. One deliberate difference: upstream's ``scale`` leaves the loss
unscaled for the ZeRO-0 fp16 wrappers (FP16_Optimizer, FP16_UnfusedOptimizer; entry
``fp16-zero0-loss-scale``), whose ``step`` unscales by ``cur_scale`` all the same; on the releases this fix
patches, ``engine.backward`` scales there through ``optimizer.backward`` (``loss.float() * cur_scale``), and
so does this ``scale``, which is what makes a direct backward after it correct. Without ``scale`` a direct
backward that needs a loss scale (static ones too, which upstream's ``needs_scaler`` lets through) is still
refused, as is ``out.backward(grad)`` there: only a scalar loss can be scaled.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from ...fix import Fix, Probe
from ...patching import AttributePatch, DecoratedTarget, Target, import_target_module, undecorated

_ENGINE = "deepspeed.runtime.engine"
_ZERO12 = "deepspeed.runtime.zero.stage_1_and_2"
_ZERO3 = "deepspeed.runtime.zero.stage3"
_BF16 = "deepspeed.runtime.bf16_optimizer"
_FP16_FUSED = "deepspeed.runtime.fp16.fused_optimizer"
_FP16_UNFUSED = "deepspeed.runtime.fp16.unfused_optimizer"
_LOSS_SCALER = "deepspeed.runtime.fp16.loss_scaler"
_BASE_OPTIMIZER = "deepspeed.runtime.base_optimizer"
_STATE = "_fixbook_direct_backward"

_SCALE_REFUSAL = ("Direct calls to tensor.backward() are not supported in this configuration ({what}) without "
                  "engine.scale(loss); please use engine.backward(loss) or engine.scale(loss).backward() instead. "
                  "(fixbook engine-tensor-backward: the loss scale must be applied before autograd starts; "
                  "DeepSpeed {release}.)")
_UNSUPPORTED_REFUSAL = ("Direct calls to tensor.backward() are not supported in this configuration ({what}); "
                        "please use engine.backward(loss) instead. (fixbook engine-tensor-backward: the "
                        "PyTorch-compatible backward backported to DeepSpeed {release} does not cover it.)")


class EngineTensorBackward(Fix):
    targets = (
        DecoratedTarget(_ENGINE, "DeepSpeedEngine.forward"),
        DecoratedTarget(_ENGINE, "DeepSpeedEngine.backward"),
        Target(_ENGINE, "DeepSpeedEngine._backward_prologue"),
        Target(_ENGINE, "DeepSpeedEngine._do_optimizer_backward"),
        Target(_ENGINE, "DeepSpeedEngine._backward_epilogue"),
        Target(_ZERO12, "DeepSpeedZeroOptimizer.backward"),
        DecoratedTarget(_ZERO3, "DeepSpeedZeroOptimizer_Stage3.backward"),
        Target(_BF16, "BF16_Optimizer.backward"),
        # What engine.scale mirrors for the ZeRO-0 fp16 wrappers and the ZeRO optimizers' loss scaler.
        Target(_FP16_FUSED, "FP16_Optimizer.backward"),
        Target(_FP16_UNFUSED, "FP16_UnfusedOptimizer.backward"),
        Target(_LOSS_SCALER, "LossScalerBase.backward"),
    )

    def check_targets(self) -> None:
        """As :meth:`Fix.check_targets`; on 0.16.0 – 0.16.4, where none of the methods that 0.16.5 split off
        ``engine.backward`` exists, those are not checked: the inline ``backward`` target pins that code."""
        inline = _inline_engine_backward(import_target_module(_ENGINE).DeepSpeedEngine)
        for target in self.targets:
            if inline and target.module == _ENGINE and target.qualname.rsplit(".", 1)[-1] in _SPLIT_OFF:
                continue
            target.check(self.known_fingerprints(target))

    def read_code(self) -> Probe:
        engine_cls = import_target_module(_ENGINE).DeepSpeedEngine
        forward = vars(engine_cls)["forward"]
        source = inspect.getsource(undecorated(forward))
        if "register_output_backward_hooks" in source or hasattr(engine_cls, "_backward_post_hook"):
            return Probe(False, "DeepSpeedEngine.forward registers backward hooks on its outputs (PR #7665)")
        return Probe(True, "DeepSpeedEngine.forward hooks nothing: DeepSpeed's backward prologue/epilogue run only "
                           "inside engine.backward")

    def patches(self) -> list[AttributePatch]:
        engine_cls = import_target_module(_ENGINE).DeepSpeedEngine
        recipes = _optimizer_recipes()
        epilogue = _inline_backward_epilogue if _inline_engine_backward(engine_cls) else _split_backward_epilogue
        zero_optimizer = import_target_module(_BASE_OPTIMIZER).ZeROOptimizer
        patches = [
            AttributePatch(engine_cls, "forward", _hooking_forward(vars(engine_cls)["forward"], recipes, epilogue)),
            AttributePatch(engine_cls, "backward", _marking_backward(vars(engine_cls)["backward"])),
        ]
        # PR #7665's user API, added only where this release lacks it (every affected one does).
        additions = [(engine_cls, "scale", _scale), (zero_optimizer, "needs_scaler", _needs_scaler),
                     (zero_optimizer, "scale_if_loss", _scale_if_loss)]
        return patches + [AttributePatch(owner, name, new) for owner, name, new in additions
                          if not hasattr(owner, name)]


# --- the optimizer's part of engine.backward, per optimizer class ------------------------------------


@dataclass(frozen=True)
class Recipe:
    """What one optimizer class's ``backward(loss)`` does around ``loss.backward()`` on this release:
    ``refusal`` says why a direct backward cannot be mirrored (or ""), ``before``/``after`` run
    before the first gradient and after the whole pass, ``scale_reason`` says why the loss must be
    scaled before autograd (lifted by ``engine.scale(loss)``)."""

    refusal: Callable[[Any], str]
    before: Callable[[Any], None]
    after: Callable[[Any], None]
    scale_reason: Callable[[Any], str] = lambda optimizer: ""  # why the loss must be scaled first ("" if not)


def _nothing(optimizer: Any) -> None:
    return None


def _needs_loss_scale(optimizer: Any) -> str:
    """Why the ZeRO optimizer's ``backward`` would scale the loss (a hook on the outputs cannot do it
    before fp16 gradients underflow), or ""."""
    if optimizer.custom_loss_scaler:
        return f"a custom loss scale of {optimizer.external_loss_scale}"
    if getattr(optimizer, "torch_autocast_gradscaler", None) is not None:
        return "a torch.autocast GradScaler"
    if optimizer.loss_scaler.loss_scale != 1:
        return f"loss scale {optimizer.loss_scaler.loss_scale}"
    return ""


def _zero3_refusal(optimizer: Any) -> str:
    if optimizer.swap_optimizer:
        return "ZeRO-3 with NVMe optimizer swapping"
    if getattr(optimizer, "zenflow", False):
        return "ZeRO-3 with ZenFlow"
    return ""


def _optimizer_recipes() -> dict[type, Recipe]:
    zero12 = getattr(import_target_module(_ZERO12), "DeepSpeedZeroOptimizer")
    zero3 = getattr(import_target_module(_ZERO3), "DeepSpeedZeroOptimizer_Stage3")
    bf16 = getattr(import_target_module(_BF16), "BF16_Optimizer")
    if "backward_prologue" not in vars(zero12):  # 0.16.0 - 0.16.4: ZeRO-1/2's backward() written out inline
        zero12_recipe = Recipe(lambda opt: "", _zero12_inline_before, _zero12_inline_after, _needs_loss_scale)
    else:
        # ZeRO-1/2's backward() calls backward_prologue() before autograd from 0.16.5 up to 0.17.1; from
        # 0.17.2 the first gradient hook calls it.
        prologue_first = "self.backward_prologue()" in inspect.getsource(vars(zero12)["backward"])
        zero12_recipe = Recipe(lambda opt: "",
                               (lambda opt: opt.backward_prologue()) if prologue_first else _nothing,
                               lambda opt: opt.backward_epilogue(), _needs_loss_scale)
    return {
        zero12: zero12_recipe,
        zero3: Recipe(_zero3_refusal, _nothing, _nothing, _needs_loss_scale),
        bf16: Recipe(lambda opt: "", lambda opt: opt.clear_lp_grads(),
                     lambda opt: opt.update_hp_grads(clear_lp_grads=False)),
    }


def _zero12_inline_before(optimizer: Any) -> None:
    """0.16.0 – 0.16.4 ``DeepSpeedZeroOptimizer.backward`` before its ``loss_scaler.backward``."""
    import torch
    from deepspeed.accelerator import get_accelerator

    optimizer.micro_step_id += 1

    if optimizer.contiguous_gradients:
        optimizer.ipg_buffer = []
        buf_0 = torch.empty(int(optimizer.reduce_bucket_size),
                            dtype=optimizer.dtype,
                            device=get_accelerator().current_device_name())
        optimizer.ipg_buffer.append(buf_0)

        # Use double buffers to avoid data access conflict when overlap_comm is enabled.
        if optimizer.overlap_comm:
            buf_1 = torch.empty(int(optimizer.reduce_bucket_size),
                                dtype=optimizer.dtype,
                                device=get_accelerator().current_device_name())
            optimizer.ipg_buffer.append(buf_1)
        optimizer.ipg_index = 0


def _zero12_inline_after(optimizer: Any) -> None:
    """0.16.0 – 0.16.4 ``DeepSpeedZeroOptimizer.backward`` after its ``loss_scaler.backward``."""
    # Only for Stage 1, Mode 2
    if optimizer.use_grad_accum_attribute:
        optimizer.fill_grad_accum_attribute()


# --- the engine's part ---------------------------------------------------------------------------------


class _DirectBackward:
    """Per-engine state: inside ``engine.backward`` (depth), and the backward pass whose prologue ran."""

    def __init__(self) -> None:
        self.engine_backward_depth = 0
        self.pass_id: object | None = None
        self.divisor = 1
        self.scaled = False  # engine.scale(loss) was called since the last direct backward


def _state(engine: Any) -> _DirectBackward:
    state = engine.__dict__.get(_STATE)
    if state is None:
        state = engine.__dict__[_STATE] = _DirectBackward()
    return state


def _marking_backward(original: Any) -> Any:
    def backward(self, *args, **kwargs):
        # engine.backward runs its own prologue/epilogue: the output hooks must stay out of its way.
        # Nothing else changes, so its results are bit-identical with and without the fix.
        state = _state(self)
        state.engine_backward_depth += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            state.engine_backward_depth -= 1

    backward.__doc__ = original.__doc__
    backward.__wrapped__ = original  # other entries' probes read the code underneath
    return backward


_SPLIT_OFF = ("_backward_prologue", "_do_optimizer_backward", "_backward_epilogue")


def _inline_engine_backward(engine_cls: type) -> bool:
    """Whether ``engine.backward`` is written out inline (0.16.0 – 0.16.4): none of the methods 0.16.5
    split off it exists."""
    return not any(name in vars(engine_cls) for name in _SPLIT_OFF)


def _split_backward_epilogue(engine: Any) -> None:
    engine._backward_epilogue()


def _inline_backward_epilogue(engine: Any) -> None:
    """0.16.0 – 0.16.4 ``engine.backward`` after the optimizer's backward: the code 0.16.5 moved into
    ``_backward_epilogue`` unchanged."""
    from deepspeed.runtime.engine import see_memory_usage

    engine._start_timers(engine.engine_timers.backward_reduce_timers)
    if engine.enable_backward_allreduce and not engine.inside_no_sync_ctxt:
        # Traditional code path that allreduces the module parameter grads
        engine.allreduce_gradients()
    engine._stop_timers(engine.engine_timers.backward_reduce_timers)
    see_memory_usage("Engine after backward", force=engine.memory_breakdown())


def _hooking_forward(original: Any, recipes: dict[type, Recipe], epilogue: Callable[[Any], None]) -> Any:
    import torch

    pipeline_engine = _pipeline_engine_class()

    def forward(self, *inputs, **kwargs):
        outputs = original(self, *inputs, **kwargs)
        # The pipeline engine runs its own backward through stage outputs (PR #7787 is about what
        # hooking them does); an engine without an optimizer has no prologue/epilogue to run.
        if (torch.is_grad_enabled() and not (pipeline_engine and isinstance(self, pipeline_engine))
                and self.optimizer is not None and type(self.optimizer).__name__ != "DummyOptim"):
            hook = _output_hook(self, recipes, epilogue)
            for tensor in _tensors(outputs):
                if tensor.grad_fn is not None:
                    tensor.register_hook(hook)
        return outputs

    forward.__doc__ = original.__doc__
    return forward


def _pipeline_engine_class() -> type | None:
    try:
        return import_target_module("deepspeed.runtime.pipe.engine").PipelineEngine
    except (ImportError, AttributeError):
        return None


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _output_hook(engine: Any, recipes: dict[type, Recipe], epilogue: Callable[[Any], None]) -> Callable[[Any], Any]:
    def hook(grad):
        state = _state(engine)
        if state.engine_backward_depth:
            return None
        current = _current_pass()
        if state.pass_id is None or state.pass_id != current:  # the first engine output this pass reaches
            if not _accumulates_into_parameters(engine):  # e.g. torch.autograd.grad(loss, inputs)
                return None
            recipe = _prologue(engine, state, recipes)
            state.pass_id = current
            import torch

            torch.autograd.Variable._execution_engine.queue_callback(lambda: _epilogue(engine, state, recipe, epilogue))
        return None if state.divisor == 1 else grad / state.divisor

    return hook


def _current_pass() -> object:
    """The running backward pass's id where torch says it (else one id, reset by the epilogue)."""
    import torch

    get = getattr(torch._C, "_current_graph_task_id", None)
    return get() if get is not None else "pass"


def _accumulates_into_parameters(engine: Any) -> bool:
    """Whether this backward pass writes ``.grad`` of the engine's parameters (False for
    ``torch.autograd.grad`` with other inputs). True where torch lacks the internal APIs to tell."""
    import torch

    grad_acc = getattr(torch.autograd.graph, "_get_grad_fn_or_grad_acc", None)
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if grad_acc is None or will_execute is None:
        return True
    with torch.enable_grad():  # as DeepSpeed 0.18.3's count_used_parameters_in_backward
        nodes = [grad_acc(p) for p in engine.module.parameters() if p.requires_grad]
    return any(will_execute(node) for node in nodes if node is not None)


def _refusal(engine: Any, recipes: dict[type, Recipe], scaled: bool = False) -> tuple[str, str, Recipe | None]:
    """Mirror of ``_do_optimizer_backward``'s branches: (why a direct backward cannot run the same code,
    why it would need ``engine.scale(loss)`` first, the optimizer's recipe). ``scaled``: the loss
    went through ``engine.scale``."""
    optimizer = engine.optimizer
    name = type(optimizer).__name__
    for feature, on in (("eigenvalue", engine.eigenvalue_enabled()),
                        ("DeepCompile", getattr(engine, "is_deepcompile_enabled", lambda: False)()),
                        ("ZenFlow", getattr(engine, "zenflow", False)),
                        ("Apex AMP", engine.amp_enabled())):
        if on:
            return f"{feature} is enabled", "", None
    if engine.zero_optimization() or (engine.bfloat16_enabled() and type(optimizer) in recipes):
        recipe = recipes.get(type(optimizer))
        if recipe is None:
            return f"optimizer {name}", "", None
        reason = recipe.refusal(optimizer)
        if reason:
            return f"{name} with {reason}", "", None
        scale_reason = "" if scaled else recipe.scale_reason(optimizer)
        return "", (f"{name} with {scale_reason}" if scale_reason else ""), recipe
    plain = Recipe(lambda opt: "", _nothing, _nothing)
    if engine.fp16_enabled() or engine.bfloat16_enabled():
        if type(optimizer) not in _fp16_wrappers():
            return f"ZeRO stage 0 with {name}", "", None
        # FP16_Optimizer/FP16_UnfusedOptimizer.backward: scaled_loss.backward() and nothing else.
        return "", ("" if scaled else f"ZeRO stage 0 with {name}, which scales the loss by "
                    f"{getattr(optimizer, 'cur_scale', '?')} before autograd"), plain
    if getattr(engine, "torch_autocast_z0_gradscaler", None):
        return "", ("" if scaled else "ZeRO stage 0 with a torch.autocast GradScaler"), plain
    return "", "", plain  # ZeRO-0, fp32: a plain loss.backward()


def _prologue(engine: Any, state: _DirectBackward, recipes: dict[type, Recipe]) -> Recipe:
    """What ``engine.backward`` does before autograd starts (``_backward_prologue`` and the first half
    of ``_do_optimizer_backward``), for the pass now running."""
    scaled, state.scaled = state.scaled, False  # one engine.scale(loss) covers one backward pass
    refusal, scale_reason, recipe = _refusal(engine, recipes, scaled)
    if refusal or scale_reason or recipe is None:
        import deepspeed

        template = _UNSUPPORTED_REFUSAL if refusal or recipe is None else _SCALE_REFUSAL
        raise RuntimeError(template.format(what=refusal or scale_reason, release=deepspeed.__version__))
    engine._start_timers(engine.engine_timers.backward_timers)
    scale_wrt_gas = True if engine.scale_wrt_gas is None else engine.scale_wrt_gas
    reduces = engine.enable_backward_allreduce and not engine.inside_no_sync_ctxt
    gas = engine.gradient_accumulation_steps()
    # _backward_prologue divides the loss by gas; here each output gradient is divided instead.
    # (It also adds the loss to engine.losses for the monitor; a direct backward hands over no loss.)
    state.divisor = gas if reduces and gas > 1 and scale_wrt_gas else 1
    engine._start_timers(engine.engine_timers.backward_inner_timers)
    if engine.zero_optimization():
        engine.optimizer.is_gradient_accumulation_boundary = engine.is_gradient_accumulation_boundary()
    recipe.before(engine.optimizer)
    return recipe


def _epilogue(engine: Any, state: _DirectBackward, recipe: Recipe, backward_epilogue: Callable[[Any], None]) -> None:
    """What ``engine.backward`` does after autograd: the rest of the optimizer's backward and
    ``_backward_epilogue``. Runs once, after the whole backward pass (autograd's final callback)."""
    try:
        recipe.after(engine.optimizer)
        engine._stop_timers(engine.engine_timers.backward_inner_timers)
        backward_epilogue(engine)
        engine._stop_timers(engine.engine_timers.backward_timers)
    finally:
        state.pass_id, state.divisor = None, 1


# --- PR #7665's user API: engine.scale(loss), ZeROOptimizer.needs_scaler/scale_if_loss --------------------


def _fp16_wrappers() -> tuple[type, ...]:
    """The ZeRO-0 fp16 optimizers (0.17.6 – 0.18.2 also wrap bf16 without ZeRO in the unfused one)."""
    return (import_target_module(_FP16_FUSED).FP16_Optimizer, import_target_module(_FP16_UNFUSED).FP16_UnfusedOptimizer)


def _is_loss(value: Any) -> bool:
    """0.18.3's ``deepspeed.runtime.utils.maybe_loss_for_backward``: a one-element tensor with a grad_fn."""
    import torch

    return isinstance(value, torch.Tensor) and value.numel() == 1 and value.grad_fn is not None


def _scale(self, loss):
    r"""Apply loss scaler for manual backward pass (backported from DeepSpeed 0.18.3 by the Fixbook's
    engine-tensor-backward fix).

    Use this method when calling loss.backward() directly instead of engine.backward()::

        loss = criterion(engine(input), target)
        engine.scale(loss).backward()
        engine.step()

    Raises RuntimeError under Apex AMP, AssertionError if the loss is not a scalar tensor with a
    grad_fn or no optimizer is configured.
    """
    assert self.optimizer is not None and type(self.optimizer).__name__ != "DummyOptim", \
        "must provide optimizer during init in order to use scale"
    assert _is_loss(loss), \
        "loss must be a scalar tensor with grad_fn. For non-scalar tensors, use tensor.backward(grad)"
    if self.amp_enabled():
        raise RuntimeError("engine.scale() is not compatible with AMP (NVIDIA Apex). "
                           "When using AMP, you must call engine.backward(loss) instead of manual backward.")
    optimizer = self.optimizer
    scaled_loss = loss
    if isinstance(optimizer, import_target_module(_BASE_OPTIMIZER).ZeROOptimizer):
        scaled_loss = optimizer.scale_if_loss(loss)
    elif getattr(self, "torch_autocast_z0_gradscaler", None):
        scaled_loss = self.torch_autocast_z0_gradscaler.scale(loss)
    elif isinstance(optimizer, _fp16_wrappers()):
        # Unlike 0.18.3 (entry fp16-zero0-loss-scale): up to 0.18.2 engine.backward scales here through
        # FP16_Optimizer/FP16_UnfusedOptimizer.backward, and their step() unscales by cur_scale, so a
        # direct backward equals engine.backward only with this release's own scaling.
        scaled_loss = (optimizer.external_loss_scale * loss if optimizer.custom_loss_scaler else
                       loss.float() * optimizer.cur_scale)
    _state(self).scaled = True
    return scaled_loss


def _needs_scaler(self) -> bool:
    """
    Check if this optimizer requires loss scaling for correct backward pass (backported from DeepSpeed
    0.18.3).

    Returns True if any of the following conditions are met:
    - Custom loss scaler is enabled
    - torch.autocast gradient scaler is active (fp16 only)
    - Dynamic loss scaling is enabled (fp16 with DeepSpeed's loss scaler)

    Returns False for bf16 or fp32, which don't require gradient scaling.
    """
    # getattr: BF16_Optimizer has none of these attributes (on 0.18.3 too), 0.16.x no GradScaler.
    return bool(getattr(self, "custom_loss_scaler", False)
                or getattr(self, "torch_autocast_gradscaler", None) is not None
                or getattr(self, "dynamic_loss_scale", False))


def _scale_if_loss(self, value: Any) -> Any:
    """
    Applies loss scaling to the input value if it is a loss tensor (backported from DeepSpeed 0.18.3),
    the way this release's ZeRO optimizer's ``backward`` scales it.
    """
    if _is_loss(value):
        if getattr(self, "custom_loss_scaler", False):
            return self.external_loss_scale * value
        if getattr(self, "torch_autocast_gradscaler", None):
            return self.torch_autocast_gradscaler.scale(value)
        loss_scaler = getattr(self, "loss_scaler", None)
        if loss_scaler is not None:  # backward(): self.loss_scaler.backward(loss.float()) -> loss * loss_scale
            return value.float() * loss_scaler.loss_scale
        # BF16_Optimizer: its backward() does not scale
    return value


FIX = EngineTensorBackward()
