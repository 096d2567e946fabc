"""The models and runs of zero3-hooks-attribute-delegating-modules: the harness's TinyMLP with its output layer
inside an attribute-delegating wrapper, trained under ZeRO-3 on one rank, and the plain-PyTorch references.

Two wrappers, both written as the libraries that have them write them (no PEFT install needed):

* :class:`ModulesToSaveWrapper` -- PEFT's wrapper for ``modules_to_save`` (``peft.utils.other``): it keeps
  the original module frozen, trains a copy, runs the copy, and its ``__getattr__`` forwards every attribute it
  does not have to that copy. It has no parameters of its own. Its training is exactly TinyMLP's (the copy
  starts as ``fc2`` and is trained as ``fc2`` is), so :func:`fixes.harness.train_reference` is its reference in
  every dtype.
* :class:`ScaledOutputWrapper` -- an adapter wrapper with a parameter of its own: a trainable per-feature
  output scale (PEFT's IA3 learns such a vector), forwarding unknown attributes to the layer it wraps, so code
  that reads ``.weight`` or ``.out_features`` keeps working. Its reference is the same model trained in plain
  PyTorch (:func:`fixes.harness.train_reference` with the wrapped model).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...harness.versus import ScriptOutcome

PEFT = "PEFT ModulesToSaveWrapper"
SCALED = "wrapper with its own parameter"
# The lines DeepSpeed raises when the wrapper runs its child's hook classes: the post-backward class counts on
# the child's ds_grads_remaining before the child's hook has set it (forward), or the wrapper's own parameter is
# still released when backward needs it (an empty tensor of size 0).
FORWARD_ERROR = ("AttributeError", "has no attribute 'ds_grads_remaining'")
BACKWARD_ERROR = ("RuntimeError", "must match the size of tensor b (0)")


class ModulesToSaveWrapper(torch.nn.Module):
    """PEFT's ``ModulesToSaveWrapper``, reduced to what ZeRO-3 sees: the frozen original, a trainable copy per
    adapter in ``modules_to_save``, the forward through the active copy, and ``__getattr__`` that forwards what
    the wrapper does not have to that copy (``AuxiliaryTrainingWrapper.__getattr__``)."""

    def __init__(self, module_to_save: torch.nn.Module, adapter_name: str = "default") -> None:
        super().__init__()
        self.original_module = module_to_save
        self.modules_to_save = torch.nn.ModuleDict({adapter_name: copy.deepcopy(module_to_save)})
        self.active_adapter = adapter_name
        self.original_module.requires_grad_(False)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            pass
        modules = self.__dict__["_modules"]
        return getattr(modules["modules_to_save"][self.__dict__["active_adapter"]], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.modules_to_save[self.active_adapter](x)


class ScaledOutputWrapper(torch.nn.Module):
    """A layer times a trainable per-feature scale (starting at one); attributes it does not have are read from
    the layer."""

    def __init__(self, base_layer: torch.nn.Linear) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.scale = torch.nn.Parameter(torch.ones(base_layer.out_features))

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["base_layer"], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) * self.scale


def peft_model(spec: Any) -> torch.nn.Module:
    """TinyMLP whose output layer is in PEFT's wrapper: ``modules_to_save=["fc2"]``."""
    from ...harness import TinyMLP

    model = TinyMLP(spec)
    model.fc2 = ModulesToSaveWrapper(model.fc2)
    return model


def scaled_model(spec: Any) -> torch.nn.Module:
    """TinyMLP whose output layer is scaled by a wrapper with a parameter of its own."""
    from ...harness import TinyMLP

    model = TinyMLP(spec)
    model.fc2 = ScaledOutputWrapper(model.fc2)
    return model


MODELS: dict[str, Callable[[Any], torch.nn.Module]] = {PEFT: peft_model, SCALED: scaled_model}


def job(dtype: str = "float32", **changes: Any) -> Any:
    """The harness job of this entry: ZeRO-3 on one rank, every parameter released after use
    (``stage3_param_persistence_threshold: 0``, as for a real model's large layers), two SGD steps."""
    from ...harness import Job

    return Job(zero_stage=3, dtype=dtype, steps=2,
               config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


def user_script(job: Any, model_name: str = PEFT) -> dict[str, Any]:
    """One rank of the user's training script: the wrapped model, an optimizer over its trainable parameters,
    ``deepspeed.initialize`` with the job's config dict, then forward, ``engine.backward``, ``engine.step``.
    Returns the trained parameters (gathered, fp32) and the losses."""
    import deepspeed

    from ...harness import allow_fp16_on_cpu, device, ds_config, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    dtype = dtype_of(job.dtype)
    if dtype == torch.float16:
        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    model = MODELS[model_name](job.model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"params": gathered_params(engine.module), "losses": losses}


def hook_classes(job: Any, model_name: str = PEFT) -> dict[str, Any]:
    """One rank: build the engine (no training) and say, per hook class attribute, whether the wrapped child has
    its class yet (where ZeRO-3 makes them lazily, in the first forward, it has not), whether the wrapper holds
    one of its own, and whether what ``wrapper.<attribute>`` reads is the child's."""
    import deepspeed

    from ...harness import ds_config

    model = MODELS[model_name](job.model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    wrapper = engine.module.fc2
    inner = wrapper.modules_to_save["default"] if model_name == PEFT else wrapper.base_layer
    return {name: {"made at registration": name in vars(inner), "own": name in vars(wrapper),
                   "read through the wrapper is the child's":
                   name in vars(inner) and getattr(wrapper, name, None) is vars(inner)[name]}
            for name in ("pre_bwd_fn", "post_bwd_fn")}


@dataclass
class Outcome(ScriptOutcome):
    """One model's run through DeepSpeed (one launched rank) next to its plain-PyTorch reference; the weights are
    named as the reference names them."""

    frozen_kept: bool | None = None  # PEFT: the frozen original is untouched

    @property
    def bug_error(self) -> str:
        """``"forward"``/``"backward"`` where the run failed with this bug's error, else ``""``."""
        if self.error is None:
            return ""
        for where, (exc_type, text) in (("forward", FORWARD_ERROR), ("backward", BACKWARD_ERROR)):
            if self.error.exc_type == exc_type and text in self.error.message:
                return where
        return ""

    @property
    def matches(self) -> bool:
        return super().matches and self.frozen_kept is not False


def run(job: Any, model_name: str = PEFT, timeout: float = 180.0, script: Callable[..., dict[str, Any]] | None = None,
        label: str = "") -> Outcome:
    """``script`` (default :func:`user_script`) on one launched rank (a fresh process: every fix applied here is
    applied there first), and its reference: :func:`fixes.harness.train_reference` of TinyMLP for PEFT's wrapper,
    of the wrapped model itself for the other. A failed run keeps the rank's error."""
    from ...harness import launch_script, train_reference

    outcome = Outcome(label or model_name, job.dtype)
    result = launch_script(outcome, script or user_script, job, model_name, timeout=timeout)
    if result is None:
        return outcome
    if model_name == PEFT:
        outcome.params, outcome.frozen_kept = _as_tiny_mlp(result["params"], job)
        outcome.set_reference(train_reference(job))
    else:
        outcome.set_reference(train_reference(job, build_model=MODELS[model_name]))
    return outcome


def _as_tiny_mlp(params: dict[str, Any], job: Any) -> tuple[dict[str, Any], bool]:
    """The PEFT model's weights under TinyMLP's names (the trained copy is ``fc2``), and whether the frozen
    original still holds TinyMLP's initial weights (in the job's dtype)."""
    from ...harness import TinyMLP
    from ...harness.compare import dtype_of

    trained = {name.replace("fc2.modules_to_save.default.", "fc2."): value for name, value in params.items()
               if not name.startswith("fc2.original_module.")}
    initial = TinyMLP(job.model).to(dtype_of(job.dtype))
    frozen = all((params[f"fc2.original_module.{name}"] == p.detach().float().numpy()).all()
                 for name, p in initial.fc2.named_parameters())
    return trained, frozen


def counters_after_backward(job: Any, model_name: str = PEFT) -> list[dict[str, Any]]:
    """In this process: the user's script for ``job.steps`` steps, recording after each ``engine.backward`` the
    pre-backward counters (``applied_pre_backward_ref_cnt``) stored on the wrapper and on its trained child, as
    upstream's regression test (PR #8144) checks them: both 0 once backward has run, where each module has
    its own hook classes."""
    import deepspeed

    from ...harness import device, ds_config, make_batches, mse

    model = MODELS[model_name](job.model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    wrapper = engine.module.fc2
    child = wrapper.modules_to_save["default"] if model_name == PEFT else wrapper.base_layer
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    counters = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        engine.backward(mse(engine(x.to(device())), y.to(device())))
        counters.append({"wrapper": vars(wrapper).get("applied_pre_backward_ref_cnt"),
                         "child": vars(child).get("applied_pre_backward_ref_cnt"),
                         "wrapper has own hook classes": "pre_bwd_fn" in vars(wrapper) and "post_bwd_fn" in vars(wrapper)})
        engine.step()
    return counters
