"""One cell of the differential sweep: a tiny model trained a few optimizer steps through DeepSpeed, and the same
model in plain PyTorch on the same data from the same initial weights, compared step by step.

:class:`Settings` is a cell (the dimensions of ``ci/differential/space.toml``, plus the run's constants).
:func:`run_cell` trains it both ways and returns a :class:`Verdict`: *agrees*, *differs* (the largest difference,
and the first step and quantity outside the dtype's tolerance), *crashes* (DeepSpeed raised while training),
*rejected* (``deepspeed.initialize`` refused the configuration) or *could not run* (the reference does not model a
value of the cell, or the ranks could not be run).

The reference (:func:`train_reference_cell`) models what DeepSpeed documents for each dimension it judges:

* micro-batch losses divided by ``gradient_accumulation_steps`` (what ``engine.backward`` does; with
  ``loss.backward()`` the engine's hook divides the gradient entering its output instead,
  ``_backward_prologue_per_tensor``), gradients averaged over the ranks;
* the accumulation dtype (:func:`accumulation_dtype`): DeepSpeed's ``data_types.grad_accum_dtype``, which defaults
  to the model's dtype (``DeepSpeedEngine.get_data_types``), except where the optimizer DeepSpeed picks keeps fp32
  accumulation buffers itself (BF16_Optimizer; ZeRO's CPU offload);
* fp16's loss scale (the scaled loss's gradients in fp16, unscaled in fp32 before the step);
* gradient clipping: the global L2 norm over all parameters' (unscaled, accumulated, averaged) gradients; when it
  exceeds ``gradient_clipping`` every gradient is multiplied by ``clip / (norm + 1e-6)``; after accumulation,
  before the step;
* DeepSpeed's schedulers, as ``lr_schedules.py`` defines them: WarmupLR and WarmupDecayLR set every group's lr
  from the schedule (the groups' own lrs are replaced), WarmupCosineLR scales each group's own lr, OneCycle (its
  lr cycle; ``cycle_momentum`` off) sets every group's; the first step at the schedule's construction value,
  ``scheduler.step()`` after every optimizer step;
* parameter groups with their own lr and weight decay, and the torch optimizer the cell names;
* checkpoints: a save after half the steps and a load into a fresh engine (directly, or through ds_to_universal) is
  the uninterrupted run (every later step's loss and parameters are compared); zero_to_fp32's weights after the
  last step are the reference's fp32 master weights.

Values it does not model are named by :func:`reference_gaps`; such a cell is never judged.
"""
from __future__ import annotations

import math
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from .compare import compare, dtype_of
from .models import ModelSpec, TinyMLP, make_batches, mse

VERDICTS = ("agrees", "differs", "crashes", "rejected", "could not run")
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16-dynamic": "float16", "fp16-static": "float16"}
FP16_SCALE = 128.0  # fp16's loss scale here: static 128; dynamic starts at 2**7 (initial_scale_power) and stays
MODELLED_SCHEDULERS = ("none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
MODELLED_OPTIMIZERS = ("torch-adamw", "torch-sgd", "torch-adam")
MODELLED_CHECKPOINTS = ("none", "save-load", "universal", "zero-to-fp32")
REDUCE_EACH = (2, 3)  # the ZeRO stages that reduce every micro-step (reduces_every_micro_step)
CLIP_EPSILON = 1e-6  # DeepSpeed's clip_grad_norm_/unscale_and_clip_grads: clip / (norm + 1e-6)


@dataclass(frozen=True)
class Settings:
    """One cell: the space's dimensions (names and values as in ``space.toml``) and the run's constants."""

    zero_stage: int = 0
    precision: str = "fp32"
    gradient_accumulation_steps: int = 1
    grad_accum_dtype: str = "unset"
    offload_optimizer: str = "none"
    world_size: int = 1
    gradient_clipping: float = 0.0
    scheduler: str = "none"
    param_groups: int = 1
    optimizer: str = "torch-adamw"
    contiguous_gradients: bool = True
    overlap_comm: bool = False
    round_robin_gradients: bool = False
    reduce_bucket_size: Any = "default"
    stage3_param_persistence_threshold: Any = "default"
    sub_group_size: Any = "default"
    zero_init: bool = False
    checkpoint: str = "none"
    backward: str = "engine"
    # the run's constants (space.toml's [run])
    steps: int = 4
    lr: float = 0.05
    weight_decay: float = 0.01
    micro_batch: int = 4
    warmup_num_steps: int = 2
    total_num_steps: int = 4
    model: ModelSpec = field(default_factory=ModelSpec)
    data_seed: int = 1

    @property
    def dtype(self) -> torch.dtype:
        if self.precision not in PRECISION_DTYPES:
            raise ValueError(f"unknown precision {self.precision!r}; use one of {', '.join(PRECISION_DTYPES)}")
        return dtype_of(PRECISION_DTYPES[self.precision])

    @property
    def loss_scale(self) -> float:
        return FP16_SCALE if self.dtype == torch.float16 else 1.0

    @classmethod
    def from_cell(cls, cell: dict[str, Any], run: dict[str, Any] | None = None) -> "Settings":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(cell) - known)
        if unknown:
            raise ValueError(f"the harness knows no dimension(s) {unknown}")
        return cls(**{**{k: v for k, v in (run or {}).items() if k in known}, **cell})


def reference_gaps(settings: Settings) -> list[str]:
    """What of ``settings`` the reference does not model (empty: the cell can be judged)."""
    gaps = []
    if settings.scheduler not in MODELLED_SCHEDULERS:
        gaps.append(f"scheduler {settings.scheduler}")
    if settings.optimizer not in MODELLED_OPTIMIZERS:
        gaps.append(f"optimizer {settings.optimizer}")
    if settings.checkpoint not in MODELLED_CHECKPOINTS:
        gaps.append(f"checkpoint {settings.checkpoint}")
    return gaps


# ---- DeepSpeed's side ------------------------------------------------------------------------------------------

def ds_config(settings: Settings) -> dict[str, Any]:
    """The DeepSpeed config of ``settings``: only what the cell sets, plus the harness's pins (quiet logging,
    torch optimizers allowed, gradient_clipping always written: its default moved in 0.19.3)."""
    s = settings
    zero: dict[str, Any] = {"stage": s.zero_stage}
    if s.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    if not s.contiguous_gradients:
        zero["contiguous_gradients"] = False
    if s.overlap_comm:
        zero["overlap_comm"] = True
    if s.round_robin_gradients:
        zero["round_robin_gradients"] = True
    for key in ("reduce_bucket_size", "stage3_param_persistence_threshold", "sub_group_size"):
        if getattr(s, key) != "default":
            zero[key] = getattr(s, key)
    dtype = s.dtype
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": s.micro_batch,
        "gradient_accumulation_steps": s.gradient_accumulation_steps,
        "train_batch_size": s.micro_batch * s.gradient_accumulation_steps * s.world_size,
        "gradient_clipping": float(s.gradient_clipping),
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.float16:
        config["fp16"] = ({"enabled": True, "loss_scale": 0, "initial_scale_power": int(math.log2(FP16_SCALE))}
                          if s.precision == "fp16-dynamic" else {"enabled": True, "loss_scale": FP16_SCALE})
    else:
        config["fp16"] = {"enabled": False}
    if s.grad_accum_dtype != "unset":
        config["data_types"] = {"grad_accum_dtype": s.grad_accum_dtype}
    if s.scheduler != "none":
        params: dict[str, Any] = {"warmup_min_lr": 0.0, "warmup_max_lr": s.lr, "warmup_num_steps": s.warmup_num_steps,
                                  "warmup_type": "linear"}
        if s.scheduler == "WarmupDecayLR":
            params["total_num_steps"] = s.total_num_steps
        elif s.scheduler == "WarmupCosineLR":
            params = {"total_num_steps": s.total_num_steps, "warmup_num_steps": s.warmup_num_steps}
        elif s.scheduler == "OneCycle":
            params = {"cycle_min_lr": s.lr / 10, "cycle_max_lr": s.lr, "cycle_first_step_size": s.warmup_num_steps,
                      "cycle_momentum": False}
        config["scheduler"] = {"type": s.scheduler, "params": params}
    if s.optimizer == "ds-adamw":
        config["optimizer"] = {"type": "AdamW", "params": {"lr": s.lr, "weight_decay": s.weight_decay}}
    return config


def param_groups(settings: Settings, model: torch.nn.Module) -> list[dict[str, Any]]:
    """The optimizer's groups: one (all parameters, ``lr``, ``weight_decay``), or two as the Hugging Face Trainer
    splits them: weights with ``lr`` and ``weight_decay``, biases with ``lr / 2`` and no weight decay."""
    named = list(model.named_parameters())
    if settings.param_groups == 1:
        return [{"params": [p for _, p in named], "lr": settings.lr, "weight_decay": settings.weight_decay}]
    return [{"params": [p for n, p in named if not n.endswith("bias")], "lr": settings.lr,
             "weight_decay": settings.weight_decay},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": settings.lr / 2, "weight_decay": 0.0}]


def make_optimizer(settings: Settings, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
    if settings.optimizer == "torch-adamw":
        return torch.optim.AdamW(groups)
    if settings.optimizer == "torch-adam":
        return torch.optim.Adam(groups)
    if settings.optimizer == "torch-sgd":
        return torch.optim.SGD(groups)
    raise ValueError(f"no torch optimizer for {settings.optimizer!r}")


class Rejected(Exception):
    """``deepspeed.initialize`` refused the configuration."""


def run_rank(settings: Settings, checkpoint_dir: str = "") -> dict[str, Any]:
    """One rank of the cell through DeepSpeed (a :func:`fixes.harness.launch` function): {"status": "ok", "losses",
    "params" (after every step, gathered), "grad_norms", "lrs", and with ``checkpoint`` zero-to-fp32 "converted"}
    or {"status": "rejected"|"crashes", "error"}. ``checkpoint_dir``: a directory every rank sees, for the
    checkpoint dimension: save-load saves after half the steps, builds a fresh engine and loads it; universal
    converts the saved checkpoint with ds_to_universal first and loads it with ``checkpoint.load_universal``;
    zero-to-fp32 saves after the last step and converts with ``get_fp32_state_dict_from_zero_checkpoint``."""
    import os

    import torch.distributed as dist

    from .training import gathered_params

    rank = int(os.environ.get("RANK", "0"))
    try:
        engine = _build(settings)
    except Exception as exc:  # noqa: BLE001 - whatever initialize raises is its refusal
        return {"status": "rejected", "error": _line(exc), "trace": traceback.format_exc()[-2000:]}
    try:
        batches = make_batches(settings.model, settings.steps, settings.gradient_accumulation_steps,
                               settings.world_size, settings.micro_batch, settings.data_seed)
        losses, params, norms, lrs = [], [], [], []
        resume_at = settings.steps // 2 if settings.checkpoint in ("save-load", "universal") else None
        for step in range(settings.steps):
            if step == resume_at:
                engine = _resume(settings, engine, checkpoint_dir)
            place = next(engine.module.parameters()).device
            lrs.append([float(group["lr"]) for group in engine.optimizer.param_groups])
            for micro in range(settings.gradient_accumulation_steps):
                x, y = batches.micro(step, micro, rank)
                loss = mse(engine(x.to(place, settings.dtype)), y.to(place))
                if settings.backward == "engine":
                    engine.backward(loss)
                elif settings.dtype == torch.float16 and hasattr(engine, "scale"):
                    engine.scale(loss).backward()  # fp16's documented direct backward (DeepSpeedEngine.scale)
                else:
                    loss.backward()
                engine.step()
                losses.append(float(loss.item()))
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
            params.append(gathered_params(engine.module))
        result = {"status": "ok", "losses": losses, "params": params, "grad_norms": norms, "lrs": lrs,
                  "grad_accum_dtype": _resolved_accumulation(engine), "optimizer": type(engine.optimizer).__name__}
        if settings.checkpoint == "zero-to-fp32":
            engine.save_checkpoint(checkpoint_dir, tag="final")
            dist.barrier()
            if rank == 0:
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag="final")
                result["converted"] = {name: value.detach().float().cpu().numpy().copy()
                                       for name, value in state.items()}
            dist.barrier()
        return result
    except Exception as exc:  # noqa: BLE001
        status = "rejected" if refusal(exc) else "crashes"
        return {"status": status, "error": _line(exc), "trace": traceback.format_exc()[-2000:]}


def _resume(settings: Settings, engine: Any, checkpoint_dir: str) -> Any:
    """Save ``engine``'s checkpoint, build a fresh engine and load it (for universal: through ds_to_universal and
    ``checkpoint.load_universal``); returns the fresh engine."""
    import os

    import torch.distributed as dist

    engine.save_checkpoint(checkpoint_dir, tag="mid")
    dist.barrier()
    load_from, extra = checkpoint_dir, {}
    if settings.checkpoint == "universal":
        from .universal import convert

        target = os.path.join(checkpoint_dir, "mid_universal")
        if int(os.environ.get("RANK", "0")) == 0:
            convert(checkpoint_dir, target, inject_missing_state=settings.zero_stage in (1, 2))
        dist.barrier()
        extra = {"checkpoint": {"load_universal": True}}
        load_from = checkpoint_dir  # main writes latest_universal beside the tag
    del engine
    fresh = _build(settings, extra)
    path, _ = fresh.load_checkpoint(load_from, tag="mid_universal" if extra else "mid")
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {load_from}")
    return fresh


def _resolved_accumulation(engine: Any) -> str:
    """The gradient accumulation dtype the release resolved from the config (``get_data_types``): its default for
    an unset ``data_types.grad_accum_dtype`` moved between releases (fp32 for bf16 on 0.16, the model's dtype later)."""
    try:
        return str(engine.get_data_types()[1]).removeprefix("torch.")
    except Exception:  # noqa: BLE001 - a release without get_data_types: the model's dtype
        return ""


def _build(settings: Settings, extra: dict[str, Any] | None = None) -> Any:
    import deepspeed

    if settings.dtype == torch.float16:
        from .precision import allow_fp16_on_cpu

        allow_fp16_on_cpu()  # CPU reproduction only (see fixes.harness.precision); no-op on CUDA
    config = {**ds_config(settings), **(extra or {})}
    if settings.zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = TinyMLP(settings.model)
    else:
        model = TinyMLP(settings.model)
    if settings.optimizer == "ds-adamw":
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(settings, model), config=config)
    else:
        optimizer = make_optimizer(settings, param_groups(settings, model))
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def refusal(exc: BaseException) -> bool:
    """Whether an error raised while training is DeepSpeed refusing the configuration (NotImplementedError, or a
    message saying it is not supported), not a crash."""
    return isinstance(exc, NotImplementedError) or "not supported" in str(exc).lower()


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300] if str(exc) else type(exc).__name__


# ---- the reference ---------------------------------------------------------------------------------------------

def accumulation_dtype(settings: Settings, resolved: str = "") -> torch.dtype:
    """The dtype DeepSpeed sums a step's micro-batch gradients in, for ``settings``.

    ``data_types.grad_accum_dtype`` defaults to the model's dtype (``DeepSpeedEngine.get_data_types``): ZeRO-0 then
    accumulates in the parameters' ``.grad`` (DDP_BFLOAT16 / FP16 optimizers), ZeRO-1/2/3 in their gradient
    partitions of the model's dtype (with CPU offload too: measured bit for bit on 0.19.8). fp32 where the config
    asks for it (BF16_Optimizer's fp32 accumulation buffers). ``resolved``: the dtype the release resolved an unset
    ``grad_accum_dtype`` to (``DeepSpeedEngine.get_data_types``; 0.16 resolves bf16's to fp32): a moved default is
    not a difference in behaviour."""
    dtype = settings.dtype
    if dtype == torch.float32 or settings.grad_accum_dtype == "fp32":
        return torch.float32
    if settings.grad_accum_dtype == "unset" and resolved:  # the release's own default, as it resolved it
        return dtype_of(resolved)
    return dtype


def initial_zero_step(settings: Settings, resolved: str = "") -> bool:
    """Whether DeepSpeed wraps the cell's torch optimizer in FP16_UnfusedOptimizer, whose constructor steps the
    optimizer once on zero gradients (``initialize_optimizer_states``): Adam's step count (its bias correction)
    starts one ahead, and weight decay is applied once at the groups' own lr to the fp32 master weights (not to the
    model's, which the first step's forward still uses; the first step then copies the master into the model). DeepSpeed picks it
    without ZeRO for fp16 (``FP16``) and for bf16 accumulated in bf16 (``DDP_BFLOAT16``)
    (``DeepSpeedEngine._do_optimizer_sanity_check`` / ``_configure_fp16_optimizer``) with a torch optimizer."""
    return (settings.zero_stage == 0 and settings.dtype != torch.float32
            and accumulation_dtype(settings, resolved) != torch.float32)


def scheduled_lrs(settings: Settings, base_lrs: list[float]) -> list[list[float]]:
    """Every group's lr at each optimizer step. Without a scheduler the groups' own. WarmupLR/WarmupDecayLR (as
    DeepSpeed documents them, ``lr_schedules.py``): every group gets ``min + (max - min) * gamma`` with
    ``last_batch_iteration`` -1 at construction (gamma: min_lr) and one ``scheduler.step()`` after each optimizer
    step; linear warm-up ``gamma = iteration / warmup_num_steps`` below ``warmup_num_steps``; after it 1
    (WarmupLR) or ``(total - iteration) / (total - warmup)`` floored at 0 (WarmupDecayLR)."""
    if settings.scheduler == "none":
        return [list(base_lrs) for _ in range(settings.steps)]
    if settings.scheduler == "WarmupCosineLR":
        return [[lr * _cosine_ratio(settings, step - 1) for lr in base_lrs] for step in range(settings.steps)]
    if settings.scheduler == "OneCycle":
        return [[_one_cycle_lr(settings, step)] * len(base_lrs) for step in range(settings.steps)]
    low, high, warmup = 0.0, settings.lr, max(2, settings.warmup_num_steps)
    lrs = []
    for step in range(settings.steps):
        iteration = step - 1  # the schedule's iteration when this step runs
        if iteration < 0:
            gamma = 0.0
        elif iteration < warmup:
            gamma = iteration / warmup
        elif settings.scheduler == "WarmupLR":
            gamma = 1.0
        elif settings.scheduler == "WarmupDecayLR":
            gamma = max(0.0, (settings.total_num_steps - iteration) / max(1.0, settings.total_num_steps - warmup))
        else:
            raise ValueError(f"the reference does not model scheduler {settings.scheduler}")
        lrs.append([low + (high - low) * gamma for _ in base_lrs])
    return lrs


def _cosine_ratio(settings: Settings, iteration: int) -> float:
    """WarmupCosineLR's factor on each group's own lr at ``iteration`` (its defaults: log warm-up from
    ``warmup_min_ratio`` 0, cosine down to ``cos_min_ratio`` 1e-4 over ``total_num_steps``); 0 before the first
    ``scheduler.step()``."""
    if iteration < 0:
        return 0.0
    warmup = max(2, settings.warmup_num_steps)
    if iteration < warmup:
        return math.log(iteration + 1) / math.log(warmup)
    progress = min(1.0, (iteration - warmup + 1) / max(1, settings.total_num_steps - warmup))
    return max(0.0, 1e-4 + (1 - 1e-4) * (1 + math.cos(math.pi * progress)) / 2)


def _one_cycle_lr(settings: Settings, step: int) -> float:
    """OneCycle's lr for optimizer step ``step`` (every group's; ``cycle_momentum`` off): ``cycle_min_lr`` (lr / 10)
    at construction, then after ``step`` scheduler steps up to ``cycle_max_lr`` over ``cycle_first_step_size``
    iterations and down again over as many (no stairs, no decay)."""
    low, high, size = settings.lr / 10, settings.lr, float(settings.warmup_num_steps)
    if step == 0:
        return low
    total = 2 * size
    if step - 1 >= total:  # past the cycle: decay is off, so cycle_min_lr
        return low
    x = 1.0 + step / total - math.floor(1 + step / total)
    scale = x / 0.5 if x <= 0.5 else (x - 1) / (0.5 - 1)
    return low + (high - low) * scale


@dataclass(frozen=True)
class Trace:
    losses: list[float]
    params: list[dict[str, np.ndarray]]  # after every optimizer step
    grad_norms: list[float | None]
    lrs: list[list[float]]
    master: dict[str, np.ndarray] = field(default_factory=dict)  # the fp32 master weights after the last step


def train_reference_cell(settings: Settings, resolved: str = "") -> Trace:
    """``settings`` in plain PyTorch (see the module's docstring for what it models); ``resolved``: the
    accumulation dtype the release resolved an unset ``grad_accum_dtype`` to (:func:`accumulation_dtype`)."""
    from .training import original_functional_linear

    gaps = reference_gaps(settings)
    if gaps:
        raise NotImplementedError(f"the reference does not model {', '.join(gaps)}")
    dtype, gas, world = settings.dtype, settings.gradient_accumulation_steps, settings.world_size
    batches = make_batches(settings.model, settings.steps, gas, world, settings.micro_batch, settings.data_seed)
    with original_functional_linear():
        master = TinyMLP(settings.model)
        work = TinyMLP(settings.model).to(dtype)
        with torch.no_grad():  # DeepSpeed casts the model first and makes its fp32 master from that copy
            for param, low in zip(master.parameters(), work.parameters()):
                param.copy_(low.float())
        groups = param_groups(settings, master)
        optimizer = make_optimizer(settings, groups)
        if initial_zero_step(settings, resolved):
            for param in master.parameters():
                param.grad = torch.zeros_like(param)
            optimizer.step()  # weight decay moves the master; the model keeps its weights until the first step
            optimizer.zero_grad()
        plan = scheduled_lrs(settings, [group["lr"] for group in groups])
        losses, params, norms = [], [], []
        for step in range(settings.steps):
            for group, lr in zip(optimizer.param_groups, plan[step]):
                group["lr"] = lr
            averaged = _step_gradients(settings, work, batches, step, losses, resolved)
            norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in averaged])))
            norms.append(norm)
            if settings.gradient_clipping > 0:
                coefficient = settings.gradient_clipping / (norm + CLIP_EPSILON)
                if coefficient < 1:
                    averaged = [g * coefficient for g in averaged]
            for param, grad in zip(master.parameters(), averaged):
                param.grad = grad
            optimizer.step()
            optimizer.zero_grad()
            with torch.no_grad():
                for param, low in zip(master.parameters(), work.parameters()):
                    low.copy_(param)
            params.append({name: p.detach().float().numpy().copy() for name, p in work.named_parameters()})
    return Trace(losses, params, norms, plan,
                 {name: p.detach().float().numpy().copy() for name, p in master.named_parameters()})


def reduces_every_micro_step(settings: Settings) -> bool:
    """Whether DeepSpeed averages each micro-batch's gradients over the ranks as backward produces them and
    accumulates the averages (ZeRO-2 and ZeRO-3: their backward hooks reduce into the gradient partitions every
    micro-step), instead of accumulating each rank's own gradients and averaging the sums at the boundary
    (ZeRO-0's all-reduce, ZeRO-1's). With one rank, or in fp32, both orders give the same within tolerance."""
    return settings.zero_stage in REDUCE_EACH


def _step_gradients(settings: Settings, work: torch.nn.Module, batches: Any, step: int,
                    losses: list[float], resolved: str = "") -> list[torch.Tensor]:
    """One step's gradients as the fp32 master receives them: every rank's micro-batch gradients of
    ``loss * loss_scale / gas`` in the model's dtype, accumulated in :func:`accumulation_dtype` and averaged over the
    ranks in the order :func:`reduces_every_micro_step` says, then unscaled in fp32. Where the sums are fp32 and
    the model is not, they are all-reduced in the model's dtype: ``communication_data_type`` defaults to it
    (BF16_Optimizer's all-reduce of its fp32 accumulation buffers; measured bit for bit on 0.19.8). Rank 0's
    losses go to ``losses``."""
    dtype, accumulate, scale = settings.dtype, accumulation_dtype(settings, resolved), settings.loss_scale
    gas, world = settings.gradient_accumulation_steps, settings.world_size
    each = reduces_every_micro_step(settings)
    sums: list[list[torch.Tensor] | None] = [None] * world
    total: list[torch.Tensor] | None = None
    for micro in range(gas):
        micro_grads = []
        for rank in range(world):
            x, y = batches.micro(step, micro, rank)
            output = work(x.to(dtype))
            if settings.backward == "tensor":  # the engine's hook on its output divides the incoming gradient
                output.register_hook(lambda grad: grad / gas)
                loss = mse(output, y)
                micro_grads.append(torch.autograd.grad(loss * scale, list(work.parameters())))
            else:  # engine.backward(loss) divides the loss
                loss = mse(output, y)
                micro_grads.append(torch.autograd.grad(loss * (scale / gas), list(work.parameters())))
            if rank == 0:
                losses.append(float(loss.item()))
        if each:  # the ranks' average of this micro-batch (in the model's dtype), accumulated
            mean = [_rank_mean([grads[i] for grads in micro_grads]).to(accumulate) for i in range(len(micro_grads[0]))]
            total = mean if total is None else [a + g for a, g in zip(total, mean)]
        else:
            for rank, grads in enumerate(micro_grads):
                grads = [g.to(accumulate) for g in grads]
                sums[rank] = grads if sums[rank] is None else [a + g for a, g in zip(sums[rank], grads)]
    if not each:
        if world > 1 and accumulate != dtype:  # fp32 sums all-reduced in communication_data_type: the model's dtype
            sums = [[g.to(dtype) for g in grads] for grads in sums]
        total = [_rank_mean([sums[rank][i] for rank in range(world)]) for i in range(len(sums[0]))]
    return [g.float() / scale for g in total]


def _rank_mean(values: list[torch.Tensor]) -> torch.Tensor:
    """The all-reduce's average in the values' dtype: summed in rank order, times 1/world_size."""
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total * (1.0 / len(values))


# ---- the verdict -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    verdict: str  # one of VERDICTS
    max_diff: float | None = None  # the largest difference over every compared quantity
    first_step: int | None = None  # the first optimizer step (0-based) with a quantity outside the tolerance
    quantity: str = ""  # which: "loss", "parameters", "grad norm", "lr"
    quantities: tuple[str, ...] = ()  # every quantity outside the tolerance at some step
    error: str = ""  # crashes / rejected / could not run: why
    note: str = ""  # agrees under an equivalent reading (GA_PLACEMENT_NOTE)
    seconds: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()
                if value not in (None, "", ())}


def judge(settings: Settings, deepspeed: dict[str, Any], reference: Trace) -> Verdict:
    """Compare rank 0's DeepSpeed trace with the reference step by step under the dtype's tolerance: the lr of
    every group, the losses of the step's micro-batches, the gradient norm (where DeepSpeed reports one), the
    parameters after the step."""
    dtype = settings.dtype
    gas = settings.gradient_accumulation_steps
    largest, first, outside = 0.0, None, []
    for step in range(settings.steps):
        checks = [("lr", deepspeed["lrs"][step], reference.lrs[step]),
                  ("loss", deepspeed["losses"][step * gas:(step + 1) * gas], reference.losses[step * gas:(step + 1) * gas])]
        if deepspeed["grad_norms"][step] is not None:
            checks.append(("grad norm", deepspeed["grad_norms"][step], reference.grad_norms[step]))
        checks.append(("parameters", deepspeed["params"][step], reference.params[step]))
        for quantity, got, want in checks:
            result = compare(got if isinstance(got, dict) else np.asarray(got, dtype=np.float64),
                             want if isinstance(want, dict) else np.asarray(want, dtype=np.float64), dtype, quantity)
            if math.isnan(result.max_abs_diff):
                largest = math.nan
            elif not math.isnan(largest):
                largest = max(largest, result.max_abs_diff)
            if not result.close:
                first = first or (step, quantity)
                outside += [quantity] if quantity not in outside else []
    if "converted" in deepspeed:  # zero_to_fp32's weights against the reference's fp32 master weights
        result = compare(deepspeed["converted"], reference.master, dtype, "converted weights")
        largest = result.max_abs_diff if math.isnan(result.max_abs_diff) else max(largest, result.max_abs_diff)
        if not result.close:
            first = first or (settings.steps - 1, "converted weights")
            outside.append("converted weights")
    if first is None:
        return Verdict("agrees", max_diff=largest)
    return Verdict("differs", max_diff=largest, first_step=first[0], quantity=first[1], quantities=tuple(outside))


def run_cell(settings: Settings, timeout: float = 180.0) -> Verdict:
    """The cell's verdict: its DeepSpeed run on ``world_size`` launched ranks (:func:`fixes.harness.launch`; each a
    fresh process, so no cell sees another's DeepSpeed state) against the reference."""
    from ..exceptions import HarnessError
    from .launch import launch

    started = time.monotonic()
    gaps = reference_gaps(settings)
    if gaps:
        return Verdict("could not run", error=f"reference does not model {', '.join(gaps)}", seconds=0.0)
    try:
        with tempfile.TemporaryDirectory(prefix="fixbook-differential-") as checkpoint_dir:
            ranks = launch(run_rank, settings.world_size, settings, checkpoint_dir, timeout=timeout)
    except HarnessError as exc:
        return Verdict("crashes", error=_line(exc), seconds=round(time.monotonic() - started, 1))
    statuses = [rank["status"] for rank in ranks]
    for status in ("rejected", "crashes"):
        if status in statuses:
            failed = ranks[statuses.index(status)]
            return Verdict(status, error=failed["error"], seconds=round(time.monotonic() - started, 1))
    resolved = ranks[0].get("grad_accum_dtype", "")
    verdict = judge(settings, ranks[0], train_reference_cell(settings, resolved))
    if verdict.verdict == "differs" and settings.gradient_accumulation_steps > 1:
        other = "tensor" if settings.backward == "engine" else "engine"
        alternative = judge(settings, ranks[0], train_reference_cell(replace(settings, backward=other), resolved))
        if alternative.verdict == "agrees":
            verdict = replace(alternative, note=GA_PLACEMENT_NOTE[other])
    return Verdict(**{**asdict(verdict), "seconds": round(time.monotonic() - started, 1)})


# Dividing by gradient_accumulation_steps on the loss or on the gradient entering the model's output is the same
# arithmetic rounded in another place; releases differ in which they do (0.19.3's engine.backward divides on the
# output's gradient, 0.19.8's on the loss). A cell that agrees only under the other placement agrees, with this note.
GA_PLACEMENT_NOTE = {
    "tensor": "agrees with GA's division on the output's gradient (the engine's per-tensor hook) instead of the loss",
    "engine": "agrees with GA's division on the loss instead of the output's gradient",
}
