"""The model and runs of zero3-activation-checkpoint-frozen-params: the harness's TinyMLP with a frozen LayerNorm in
front of its first layer, the norm and first layer under ``torch.utils.checkpoint`` (the shape of a PEFT/LoRA or
adapter model whose frozen base runs with gradient checkpointing), trained under ZeRO-3 on one rank, and its
plain-PyTorch reference.

Variants (:data:`VARIANTS`): the norm frozen under non-reentrant checkpointing (the bug), the same model without
checkpointing, and the norm trainable under non-reentrant checkpointing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from ...harness.versus import ScriptOutcome

NON_REENTRANT = "frozen norm, non-reentrant checkpoint"
UNCHECKPOINTED = "frozen norm, no checkpointing"
TRAINABLE = "trainable norm, non-reentrant checkpoint"
# variant -> (checkpointed, norm frozen)
VARIANTS: dict[str, tuple[bool, bool]] = {NON_REENTRANT: (True, True), UNCHECKPOINTED: (False, True),
                                          TRAINABLE: (True, False)}
# torch.utils.checkpoint's error when a recomputed tensor's shape differs from the forward's
BUG_ERROR = ("CheckpointError", "Recomputed values for the following tensors have different metadata")


class CheckpointedFrozenNormMLP(torch.nn.Module):
    """``fc2(tanh(fc1(norm(x))))`` with ``norm`` (a LayerNorm with seeded, non-trivial weights) frozen, and
    ``norm`` → ``fc1`` → ``tanh`` run under non-reentrant ``torch.utils.checkpoint.checkpoint`` (``checkpointed``) on
    an input that requires grad."""

    def __init__(self, spec: Any, checkpointed: bool = True, frozen: bool = True) -> None:
        super().__init__()
        from ...harness.models import SeededLinear

        self.checkpointed = checkpointed
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.norm = torch.nn.LayerNorm(spec.in_features)
            with torch.no_grad():
                self.norm.weight.copy_(1 + 0.5 * torch.randn(spec.in_features))
                self.norm.bias.copy_(0.1 * torch.randn(spec.in_features))
            self.fc1 = SeededLinear(spec.in_features, spec.hidden)
            self.act = torch.nn.Tanh()
            self.fc2 = SeededLinear(spec.hidden, spec.out_features)
        self.norm.requires_grad_(not frozen)

    def block(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc1(self.norm(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        # the input requires grad, as Hugging Face's enable_input_require_grads() makes it for gradient
        # checkpointing over a frozen base
        x = x.detach().requires_grad_()
        hidden = checkpoint(self.block, x, use_reentrant=False) if self.checkpointed else self.block(x)
        return self.fc2(hidden)


class FrozenAsBuffers(CheckpointedFrozenNormMLP):
    """The plain-PyTorch reference of a frozen variant: the same model with the frozen norm's weight and bias held
    as buffers (:func:`fixes.harness.train_reference` differentiates every parameter), so its parameters are the
    trainable ones, by the same names."""

    def __init__(self, spec: Any, checkpointed: bool = True) -> None:
        super().__init__(spec, checkpointed=checkpointed, frozen=True)
        weight, bias = self.norm.weight.detach().clone(), self.norm.bias.detach().clone()
        del self.norm.weight, self.norm.bias
        self.norm.register_buffer("weight", weight)
        self.norm.register_buffer("bias", bias)


def build(variant: str, spec: Any) -> CheckpointedFrozenNormMLP:
    checkpointed, frozen = VARIANTS[variant]
    return CheckpointedFrozenNormMLP(spec, checkpointed=checkpointed, frozen=frozen)


def reference_model(variant: str, spec: Any) -> torch.nn.Module:
    """:func:`build`'s model for :func:`fixes.harness.train_reference`: its frozen parameters as buffers."""
    checkpointed, frozen = VARIANTS[variant]
    return FrozenAsBuffers(spec, checkpointed) if frozen else build(variant, spec)


def job(dtype: str = "float32", **changes: Any) -> Any:
    """The harness job of this entry: ZeRO-3 on one rank, every parameter released after use
    (``stage3_param_persistence_threshold: 0``, as for a real model's large layers), two SGD steps."""
    from ...harness import Job

    return Job(zero_stage=3, dtype=dtype, steps=2,
               config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


def user_script(job: Any, variant: str = NON_REENTRANT) -> dict[str, Any]:
    """One rank of the user's training script: the model, an optimizer over its trainable parameters,
    ``deepspeed.initialize`` with the job's config dict, then forward, ``engine.backward``, ``engine.step``.
    Returns the trained parameters (gathered, fp32), the losses, and after each backward the parameters still
    gathered (ZeRO-3 should have released every one)."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from ...harness import allow_fp16_on_cpu, device, ds_config, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    dtype = dtype_of(job.dtype)
    if dtype == torch.float16:
        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    model = build(variant, job.model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses, gathered = [], []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        gathered.append(sorted(name for name, p in engine.module.named_parameters()  # ZeRO-3's parameters only
                               if getattr(p, "ds_status", ZeroParamStatus.NOT_AVAILABLE) != ZeroParamStatus.NOT_AVAILABLE
                               and not p.ds_persist))
        engine.step()
        losses.append(loss.item())
    return {"params": gathered_params(engine.module), "losses": losses, "gathered": gathered}


@dataclass
class Outcome(ScriptOutcome):
    """One variant's run through DeepSpeed (one launched rank) next to its plain-PyTorch reference."""

    gathered: list[list[str]] | None = None  # per step: the parameters still gathered after engine.backward
    frozen_kept: bool | None = None  # the frozen parameters still hold their initial values

    @property
    def bug_error(self) -> bool:
        """The run failed with torch's checkpoint metadata error (a parameter recomputed as ``torch.Size([0])``)."""
        return (self.error is not None and self.error.exc_type.endswith(BUG_ERROR[0])
                and BUG_ERROR[1] in self.error.message)

    @property
    def left_gathered(self) -> list[str]:
        return sorted({name for step in (self.gathered or []) for name in step})

    @property
    def matches(self) -> bool:
        return super().matches and not self.left_gathered and self.frozen_kept is not False


def run(job: Any, variant: str = NON_REENTRANT, timeout: float = 180.0) -> Outcome:
    """:func:`user_script` on one launched rank (a fresh process: every fix applied here is applied there first)
    and :func:`fixes.harness.train_reference` of the same model in plain PyTorch. A failed run keeps the rank's
    error."""
    from ...harness import launch_script, train_reference

    outcome = Outcome(variant, job.dtype)
    result = launch_script(outcome, user_script, job, variant, timeout=timeout)
    if result is None:
        return outcome
    outcome.gathered = [list(step) for step in result["gathered"]]
    outcome.set_reference(train_reference(job, build_model=functools.partial(reference_model, variant)))
    frozen = {name: value for name, value in outcome.params.items() if name not in outcome.reference_params}
    outcome.params = {name: value for name, value in outcome.params.items() if name in outcome.reference_params}
    from ...harness.compare import dtype_of

    initial = dict(build(variant, job.model).to(dtype_of(job.dtype)).named_parameters())
    outcome.frozen_kept = all((value == initial[name].detach().float().numpy()).all() for name, value in frozen.items())
    return outcome
