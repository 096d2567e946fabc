"""The same tiny training job run two ways: through a DeepSpeed engine, and in plain PyTorch.

``Job`` pins every DeepSpeed config value whose default changed between releases, so a
difference between the two runs is a DeepSpeed behaviour, never a moved default.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from .compare import dtype_of
from .models import ModelSpec, TinyMLP, make_batches, mse


BACKWARD_MODES = ("engine", "tensor", "tensor-grad", "scaled")


@dataclass(frozen=True)
class Job:
    zero_stage: int = 0
    dtype: str = "float32"
    steps: int = 2
    micro_steps: int = 1  # gradient_accumulation_steps
    backwards: int = 1  # engine.backward calls per optimizer step with gas=1 (boundary set by hand)
    optimizer: str = "sgd"  # "sgd" or "adam" (torch optimizers: nothing to compile)
    lr: float = 0.1
    offload: bool = False  # offload_optimizer to CPU
    zero3_init: bool = False  # build the model inside deepspeed.zero.Init
    micro_batch: int = 4
    data_seed: int = 1
    model: ModelSpec = ModelSpec()
    fixes: tuple[str, ...] = ()  # applied before the engine is built
    config: dict[str, Any] = field(default_factory=dict)  # merged over ds_config()
    # How train_deepspeed runs each backward: "engine" = engine.backward(loss) (DeepSpeed's documented
    # API); "tensor" = loss.backward() on the loss of the engine's output; "tensor-grad" =
    # out.backward(dloss/dout) on the engine's (non-scalar) output, the gradient computed outside;
    # "scaled" = engine.scale(loss).backward() (0.18.3's API for a direct backward that needs a loss scale).
    backward: str = "engine"

    def __post_init__(self) -> None:
        if self.backwards > 1 and self.micro_steps > 1:
            raise ValueError("use either micro_steps (gradient accumulation) or backwards (several "
                             "backward calls per step with gas=1), not both")
        if self.backward not in BACKWARD_MODES:
            raise ValueError(f"unknown backward {self.backward!r}; use one of {', '.join(BACKWARD_MODES)}")

    @property
    def micro_batches_per_step(self) -> int:
        return self.micro_steps * self.backwards

    def with_(self, **changes: Any) -> "Job":
        return replace(self, **changes)


def bench_job(**changes: Any) -> Job:
    """A job of ``python -m ci.bench``: Adam on the bench model (:data:`~fixes.harness.models.BENCH_MODEL`),
    with ``changes`` (the entry's ZeRO stage, dtype, backward...). An entry whose fix is on the training
    path returns one from its ``reproduce.bench_job()``."""
    from .models import BENCH_MICRO_BATCH, BENCH_MODEL

    return Job(optimizer="adam", lr=1e-3, model=BENCH_MODEL, micro_batch=BENCH_MICRO_BATCH).with_(**changes)


@dataclass(frozen=True)
class TrainResult:
    params: dict[str, np.ndarray]
    losses: list[float]
    grad_norms: list[float | None]
    optimizer: str = ""


def pinned_config(dtype: torch.dtype) -> dict[str, Any]:
    """The config values every harness job pins: those whose defaults moved between releases, the
    precision switches, and quiet logging. Shared by :func:`ds_config` and the pipeline jobs."""
    return {
        "gradient_clipping": 0.0,  # became 1.0 by default in 0.19.3 (entry gradient-clipping-default-1)
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16, "loss_scale": 128, "initial_scale_power": 7},
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }


def ds_config(job: Job, world_size: int = 1) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": job.zero_stage}
    if job.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": job.micro_steps,
        "train_batch_size": job.micro_batch * job.micro_steps * world_size,
        "zero_force_ds_cpu_optimizer": False,  # torch optimizers with offload: no CPU Adam build
        "zero_optimization": zero,
        **pinned_config(dtype_of(job.dtype)),
    }
    config.update(job.config)
    return config


def make_optimizer(job: Job, params: Iterator[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if job.optimizer == "sgd":
        return torch.optim.SGD(params, lr=job.lr)
    if job.optimizer == "adam":
        return torch.optim.Adam(params, lr=job.lr)
    raise ValueError(f"unknown optimizer {job.optimizer!r}; use 'sgd' or 'adam'")


@contextlib.contextmanager
def original_functional_linear() -> Iterator[None]:
    """Run a block with PyTorch's own ``F.linear``.

    ``deepspeed.zero.Init`` replaces ``torch.nn.functional.linear`` process-wide and leaves it
    replaced (partition_parameters.py); a reference computed after it would silently run through
    DeepSpeed's code. ``torch._C._nn.linear`` is the builtin ``F.linear`` is made from.
    """
    functional = torch.nn.functional
    current = functional.linear
    functional.linear = torch._C._nn.linear
    try:
        yield
    finally:
        functional.linear = current


def train_reference(job: Job, world_size: int = 1, keep: tuple[int, ...] | None = None, *,
                    initial_zero_step: bool = False, grad_dtype: torch.dtype | None = None,
                    build_model: Callable[[ModelSpec], torch.nn.Module] | None = None,
                    build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None) -> TrainResult:
    """``job`` in plain PyTorch (:func:`train_reference_with_optimizer`, without the optimizer)."""
    return train_reference_with_optimizer(job, world_size, keep, initial_zero_step=initial_zero_step,
                                          grad_dtype=grad_dtype, build_model=build_model,
                                          build_optimizer=build_optimizer)[0]


def train_reference_with_optimizer(job: Job, world_size: int = 1, keep: tuple[int, ...] | None = None, *,
                                   initial_zero_step: bool = False, grad_dtype: torch.dtype | None = None,
                                   build_model: Callable[[ModelSpec], torch.nn.Module] | None = None,
                                   build_optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = None,
                                   ) -> tuple[TrainResult, torch.optim.Optimizer]:
    """Plain PyTorch, and the optimizer it stepped (its state is what a resume check compares): ``world_size`` data-parallel shards and ``micro_steps`` micro-batches per step,
    each micro-loss divided by ``micro_steps`` and gradients averaged over shards, as DeepSpeed
    documents; with ``backwards`` > 1 the micro-losses are summed (gas=1: no division). The recorded
    gradient norm is the global L2 norm of the averaged gradient the optimizer steps on.
    ``keep`` (micro-batch indices within a step) models a bug that drops gradients: only those
    micro-batches contribute, with the same loss scaling, e.g. ``keep=(0, 2)`` or the last alone.
    Low-precision dtypes keep fp32 master weights made from the low-precision model, like
    DeepSpeed's bf16/fp16 optimizers. ``initial_zero_step`` models DeepSpeed's FP16_UnfusedOptimizer
    (``initialize_optimizer_states``): one ``optimizer.step()`` on zero gradients before training, so
    Adam's step count (and bias correction) starts one ahead; SGD without momentum is unchanged.

    ``grad_dtype`` says in which dtype gradients are accumulated and averaged over the shards:

    * ``None`` (the default): every micro-batch's gradient is converted to fp32, divided by ``world_size`` and
      added to an fp32 sum (an fp32 all-reduce of fp32 gradient buffers). This path is unchanged by the
      option: its results are bit for bit those of the function before ``grad_dtype`` existed.
    * a dtype ``d`` (e.g. ``torch.bfloat16``): gradients stay in ``d``, as ``.grad`` of a model held in ``d``
      does under torch DDP (and DeepSpeed's all-reduce without fp32 gradient accumulation). Each shard
      adds its micro-batch gradients in ``d`` in micro-batch order; the shards' sums are added in ``d`` in
      rank order (the all-reduce's sum); that sum is multiplied by ``1/world_size`` in ``d``; only then is it
      converted to fp32 for the optimizer's master weights. With two shards this is torch DDP (gloo) on a
      model held in ``d`` bit for bit (tests/fixes/harness/test_training.py): halving is exact, so DDP's
      divide-then-sum gives the same, and a two-term sum has one order; with more shards an all-reduce
      may add in another order. With a bf16 model and ``grad_dtype=torch.bfloat16`` the result differs from
      the default by bf16 rounding of the sums; with an fp32 model and ``grad_dtype=torch.float32`` by the
      order of fp32 operations only.

    ``build_model`` builds the model from ``job.model`` (default :class:`TinyMLP`): an entry's own model, e.g. the
    wrapper a user's library puts around a layer. ``build_optimizer`` builds the optimizer over the fp32 master
    model (default: ``job.optimizer`` at ``job.lr``), e.g. a user's parameter groups. Every parameter of the model
    is trained."""
    from .env import rank_placement

    dtype = dtype_of(job.dtype)
    # Where the job's DeepSpeed runs (one process on a GPU: CUDA; ranks placed on CPU, or no GPU: CPU), so that
    # both sides round alike; on CPU every .to(place) below is a no-op and the results are bit for bit as before.
    place = torch.device(rank_placement(world_size)[0])
    batches = make_batches(job.model, job.steps, job.micro_batches_per_step, world_size, job.micro_batch,
                           job.data_seed)
    with original_functional_linear():
        master = (TinyMLP if build_model is None else build_model)(job.model).to(place)
        work = copy.deepcopy(master).to(dtype)
        with torch.no_grad():  # DeepSpeed casts the model first and makes its fp32 master from that copy
            for param, copy_ in zip(master.parameters(), work.parameters()):
                param.copy_(copy_.float())
        optimizer = make_optimizer(job, master.parameters()) if build_optimizer is None else build_optimizer(master)
        if initial_zero_step:
            for param in master.parameters():
                param.grad = torch.zeros_like(param)
            optimizer.step()
        losses: list[float] = []
        norms: list[float | None] = []
        for step in range(job.steps):
            optimizer.zero_grad()
            micro_grads = _micro_gradients(job, work, batches, step, world_size, keep, losses)
            if grad_dtype is not None:
                _average_in_dtype(micro_grads, master, world_size, keep, job.micro_batches_per_step, grad_dtype)
            else:
                for _rank, grads in micro_grads:
                    for param, grad in zip(master.parameters(), grads):
                        param.grad = grad.float() / world_size + (param.grad if param.grad is not None else 0)
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in master.parameters()]))))
            optimizer.step()
            with torch.no_grad():
                for param, copy_ in zip(master.parameters(), work.parameters()):
                    copy_.copy_(param)
        params = {name: p.detach().float().cpu().numpy().copy() for name, p in work.named_parameters()}
    return TrainResult(params, losses, norms, type(optimizer).__name__), optimizer


def _micro_gradients(job: Job, work: torch.nn.Module, batches: Any, step: int, world_size: int,
                     keep: tuple[int, ...] | None, losses: list[float]) -> Iterator[tuple[int, tuple[torch.Tensor, ...]]]:
    """One step's (rank, gradients) of ``work`` for every kept micro-batch and shard, micro-batch by
    micro-batch, rank by rank, each micro-loss divided by ``micro_steps``; appends each micro-loss to ``losses``."""
    dtype = dtype_of(job.dtype)
    place = next(work.parameters()).device
    for micro in range(job.micro_batches_per_step):
        if keep is not None and micro not in keep:
            continue
        for rank in range(world_size):
            x, y = batches.micro(step, micro, rank)
            loss = mse(work(x.to(place, dtype)), y.to(place)) / job.micro_steps
            grads = torch.autograd.grad(loss, list(work.parameters()))
            losses.append(loss.item() * job.micro_steps)
            yield rank, grads


def _average_in_dtype(micro_grads: Iterable[tuple[int, tuple[torch.Tensor, ...]]], master: torch.nn.Module,
                      world_size: int, keep: tuple[int, ...] | None, micro_batches: int,
                      grad_dtype: torch.dtype) -> None:
    """One step's gradients for :func:`train_reference_with_optimizer` with ``grad_dtype`` set: accumulated
    per shard in ``grad_dtype``, summed over the shards in ``grad_dtype``, times ``1/world_size`` in
    ``grad_dtype``, then set as the fp32 master's ``.grad``."""
    shards: list[list[torch.Tensor] | None] = [None] * world_size
    for rank, micro_grads_of_rank in micro_grads:
        grads = [grad.to(grad_dtype) for grad in micro_grads_of_rank]
        kept = shards[rank]
        shards[rank] = grads if kept is None else [total + grad for total, grad in zip(kept, grads)]
    if any(shard is None for shard in shards):
        raise ValueError(f"keep={keep!r} keeps no micro-batch of the {micro_batches} in a step")
    for index, param in enumerate(master.parameters()):
        total = shards[0][index]
        for rank in range(1, world_size):  # the all-reduce's sum, in grad_dtype
            total = total + shards[rank][index]
        param.grad = (total * (1.0 / world_size)).float()


def build_engine(job: Job) -> Any:
    """``deepspeed.initialize`` for ``job`` in this process (after :func:`fixes.harness.setup`),
    applying ``job.fixes`` first (and, for fp16 jobs on the CPU accelerator,
    :func:`fixes.harness.allow_fp16_on_cpu`). Returns the engine."""
    import deepspeed

    import fixes

    if job.fixes:
        fixes.apply(*job.fixes)
    if dtype_of(job.dtype) == torch.float16:
        from .precision import allow_fp16_on_cpu

        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    config = ds_config(job, int(os.environ.get("WORLD_SIZE", "1")))
    if job.zero3_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = TinyMLP(job.model)
    else:
        model = TinyMLP(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                           config=config)
    return engine


def train_deepspeed(job: Job) -> TrainResult:
    """Train through a DeepSpeed engine in this process (after :func:`fixes.harness.setup`).

    This rank uses its own shard of every micro-batch. Returns full (gathered) parameters.
    """
    from .env import device

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    dtype = dtype_of(job.dtype)
    engine = build_engine(job)
    batches = make_batches(job.model, job.steps, job.micro_batches_per_step, world_size, job.micro_batch,
                           job.data_seed)
    losses: list[float] = []
    norms: list[float | None] = []
    for step in range(job.steps):
        for micro in range(job.micro_batches_per_step):
            x, y = batches.micro(step, micro, rank)
            if job.backwards > 1:  # several backward calls, one optimizer step (upstream PR #7665 style)
                engine.set_gradient_accumulation_boundary(micro == job.backwards - 1)
            loss = _backward(engine, job.backward, engine(x.to(device(), dtype)), y.to(device()))
            if job.backwards == 1 or micro == job.backwards - 1:
                engine.step()
            losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return TrainResult(gathered_params(engine.module), losses, norms, type(engine.optimizer).__name__)


def _backward(engine: Any, mode: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """One backward pass of ``mse(output, target)`` the way ``mode`` says (see ``Job.backward``);
    returns the loss."""
    if mode == "engine":
        loss = mse(output, target)
        engine.backward(loss)
    elif mode == "tensor":
        loss = mse(output, target)
        loss.backward()
    elif mode == "scaled":
        loss = mse(output, target)
        engine.scale(loss).backward()
    elif mode == "tensor-grad":  # a loss defined outside the model: only dloss/doutput comes back
        detached = output.detach().requires_grad_()
        loss = mse(detached, target)
        (grad,) = torch.autograd.grad(loss, detached)
        output.backward(grad)
    else:
        raise ValueError(f"unknown backward {mode!r}; use one of {', '.join(BACKWARD_MODES)}")
    return loss


def gathered_params(module: torch.nn.Module) -> dict[str, np.ndarray]:
    """Full parameter values as fp32 numpy, gathering ZeRO-3 partitions when needed."""
    # the gather that waits for every parameter on CPU too (see gathered_parameters)
    from ..zero3 import gathered_parameters

    with gathered_parameters(module) as params:
        return {name: p.float().cpu().numpy().copy() for name, p in params.items()}


def run_job(job: Job) -> TrainResult:
    """Entry point for :func:`fixes.harness.launch`: one rank of ``job``."""
    return train_deepspeed(job)
