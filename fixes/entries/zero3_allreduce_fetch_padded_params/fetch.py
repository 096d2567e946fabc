"""ZeRO-3 with ``"stage3_use_all_reduce_for_fetch_params": true`` on two ranks, a model whose parameters are
all padded (an odd number of elements each: with two ranks every partition has one slot of padding), trained
the way a user trains it, next to plain PyTorch data parallelism on the same shards.

The padding DeepSpeed reads is memory it never writes, so what the bug adds depends on the allocator. The
ranks turn on PyTorch's reproducibility switch, ``torch.use_deterministic_algorithms(True, warn_only=True)``,
under which PyTorch fills the memory it hands out uninitialised (``torch.empty``) with NaN
(``torch.utils.deterministic.fill_uninitialized_memory``): what the padding holds is then the same in every run,
and where DeepSpeed never reads it (the fixed fetch) nothing changes.

Each rank also records the weights its first forward pass computes with (a forward pre-hook on every module
with parameters, registered after ``deepspeed.initialize``, so it runs after ZeRO-3's fetch), to compare with
the weights the model was built with.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...exceptions import CannotTellError
from ...harness.compare import compare, dtype_of
from ...harness.models import ModelSpec, TinyMLP, make_batches, mse
from ...harness.training import Job, ds_config, make_optimizer

# Linear(7, 5) -> Tanh -> Linear(5, 3): 35, 5, 15 and 3 elements, all odd, so all padded on two ranks
PADDED = ModelSpec(in_features=7, hidden=5, out_features=3)
WORLD_SIZE = 2


# ZeRO's gradient bucket, in elements: it holds every gradient of PADDED (58 elements), so the gradients are
# reduced exactly as with the default bucket, which holds 5e8. ZeRO-3 allocates its bucket with torch.empty when it
# builds the engine, and under the reproducibility switch (train) PyTorch fills that memory with NaN: with the
# default, each rank wrote 2 GB (in fp32) at every engine build: seconds, and no part of any result.
REDUCE_BUCKET_SIZE = 10_000


def fetch_job(dtype: str = "float32", **changes: Any) -> Job:
    """The user's job: ZeRO-3 with the all_reduce fetch, every parameter partitioned (a tiny model's
    parameters are below the default ``stage3_param_persistence_threshold`` and would never be fetched), Adam,
    a gradient bucket sized for the model (:data:`REDUCE_BUCKET_SIZE`)."""
    return Job(zero_stage=3, dtype=dtype, steps=3, optimizer="adam", lr=1e-2, model=PADDED, config={
        "zero_optimization": {"stage": 3, "stage3_use_all_reduce_for_fetch_params": True,
                              "stage3_param_persistence_threshold": 0,
                              "reduce_bucket_size": REDUCE_BUCKET_SIZE}}).with_(**changes)


def watch_forward(module: torch.nn.Module) -> tuple[dict[str, np.ndarray], list[Any]]:
    """Record, for every parameter of ``module``, the values the first forward pass computes with. Returns the
    record (filled as the forward runs) and the hook handles. Register after ``deepspeed.initialize``: the hooks
    then run after ZeRO-3's own pre-forward hook has fetched the parameters."""
    seen: dict[str, np.ndarray] = {}
    handles = []
    for prefix, sub in module.named_modules():
        own = list(sub.named_parameters(recurse=False))
        if not own:
            continue

        def record(_module: torch.nn.Module, _inputs: Any, prefix: str = prefix, own: list = own) -> None:
            for name, param in own:
                key = f"{prefix}.{name}" if prefix else name
                if key not in seen:
                    if tuple(param.shape) != tuple(getattr(param, "ds_shape", param.shape)):
                        raise CannotTellError(f"{key} is not gathered when the forward runs: the hook ran before "
                                              "ZeRO-3's fetch")
                    seen[key] = param.detach().float().cpu().numpy().copy()

        handles.append(sub.register_forward_pre_hook(record))
    return seen, handles


def train(job: Job, deterministic: bool = True) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): the user's training script. Returns the losses, the weights
    the model was built with, those the first forward computed with, and the full weights after training.
    ``deterministic=False`` leaves PyTorch's reproducibility switch off: the padding then holds whatever the
    allocator hands out."""
    import deepspeed

    import fixes
    from ...harness.env import device
    from ...harness.precision import allow_fp16_on_cpu
    from ...harness.training import gathered_params

    if job.fixes:
        fixes.apply(*job.fixes)
    dtype = dtype_of(job.dtype)
    if dtype == torch.float16:
        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])

    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)  # the user's reproducibility switch

    model = TinyMLP(job.model)
    built = {name: p.detach().to(dtype).float().numpy().copy() for name, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                           config=ds_config(job, world_size))
    seen, hooks = watch_forward(engine.module)
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, rank)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        for hook in hooks:  # the first forward is recorded
            hook.remove()
        hooks = []
    return {"losses": np.array(losses), "built": built, "seen": seen, "params": gathered_params(engine.module)}


def wrong_elements(seen: dict[str, np.ndarray], built: dict[str, np.ndarray]) -> dict[str, list[int]]:
    """{parameter: flat indices} where the forward's weights are not exactly the model's."""
    wrong = {}
    for name, want in built.items():
        got = seen[name].reshape(-1)
        bad = np.flatnonzero(~((got == want.reshape(-1)) | (np.isnan(got) & np.isnan(want.reshape(-1)))))
        if bad.size:
            wrong[name] = bad.tolist()
    return wrong


@dataclass(frozen=True)
class FetchRun:
    """Both ranks of one run, next to plain PyTorch data parallelism on the same shards."""

    job: Job
    losses: np.ndarray  # [rank, step]
    reference_losses: np.ndarray  # [rank, step]
    params: dict[str, np.ndarray]  # rank 0's full weights after training
    reference_params: dict[str, np.ndarray]
    built: dict[str, np.ndarray]  # the model's weights in the job's dtype, as deepspeed.initialize got them
    seen: tuple[dict[str, np.ndarray], ...]  # per rank: what the first forward computed with

    @property
    def wrong(self) -> tuple[dict[str, list[int]], ...]:
        """Per rank: the elements the first forward computed with that are not the model's."""
        return tuple(wrong_elements(seen, self.built) for seen in self.seen)

    @property
    def largest_finite_difference(self) -> float:
        """The largest |weight - plain PyTorch's| over the elements where both are finite (0.0 if none): a
        number for a record, where the run's own difference may be NaN."""
        diffs = np.concatenate([np.abs(self.params[k].astype(np.float64) - self.reference_params[k]).reshape(-1)
                                for k in self.reference_params])
        finite = diffs[np.isfinite(diffs)]
        return float(finite.max()) if finite.size else 0.0

    @property
    def matches_reference(self) -> bool:
        return (compare(self.losses, self.reference_losses, self.job.dtype).close
                and compare(self.params, self.reference_params, self.job.dtype).close)

    def __str__(self) -> str:
        wrong = {name: [f"[{i}] {self.seen[0][name].reshape(-1)[i]:g} (built {self.built[name].reshape(-1)[i]:g})"
                        for i in indices] for name, indices in self.wrong[0].items()}
        return (f"{self.job.dtype}: losses per rank and step {np.round(self.losses, 6).tolist()} vs plain PyTorch "
                f"{np.round(self.reference_losses, 6).tolist()}\n"
                f"  rank 0's first forward computed with wrong elements: {wrong or 'none'}")


def train_all(jobs: list[Job], deterministic: bool = True) -> list[dict[str, Any]]:
    """One rank (for :func:`fixes.harness.launch`): :func:`train` for each job, one after the other. Under the
    reproducibility switch what the padding holds does not depend on what the rank ran before (NaN)."""
    return [train(job, deterministic) for job in jobs]


def _fetch_run(job: Job, results: list[dict[str, Any]]) -> FetchRun:
    """``job``'s per-rank results next to plain PyTorch data parallelism on the same shards."""
    from ...harness.training import train_reference

    reference = train_reference(job, WORLD_SIZE)
    reference_losses = np.array(reference.losses).reshape(job.steps, WORLD_SIZE).T
    return FetchRun(job, np.stack([r["losses"] for r in results]), reference_losses, results[0]["params"],
                    reference.params, results[0]["built"], tuple(r["seen"] for r in results))


def run(job: Job, deterministic: bool = True, timeout: float = 180) -> FetchRun:
    """``job`` on :data:`WORLD_SIZE` fresh ranks (:func:`train`) and in plain PyTorch."""
    from ...harness.launch import launch

    return _fetch_run(job, launch(train, WORLD_SIZE, job, deterministic, timeout=timeout))


def run_all(jobs: list[Job], deterministic: bool = True, timeout: float = 180) -> list[FetchRun]:
    """:func:`run` for each job, all in one launch of :data:`WORLD_SIZE` fresh ranks (:func:`train_all`): each
    job applies its ``fixes`` in the ranks before it trains, and they stay applied for the jobs after it."""
    from ...harness.launch import launch

    per_rank = launch(train_all, WORLD_SIZE, list(jobs), deterministic, timeout=timeout)
    return [_fetch_run(job, [results[index] for results in per_rank]) for index, job in enumerate(jobs)]


__all__ = ["FetchRun", "PADDED", "REDUCE_BUCKET_SIZE", "WORLD_SIZE", "fetch_job", "run", "run_all", "train",
           "train_all", "watch_forward", "wrong_elements"]
