"""A tiny two-stage pipeline job: the same sequential model trained through DeepSpeed's pipeline
engine (``deepspeed.pipe.PipelineModule`` + ``engine.train_batch``) on ``stages`` ranks, and in plain
PyTorch (:func:`train_sequential`), compared (:func:`versus_sequential`).

The model is ``Linear(in, hidden) → Tanh → Linear(hidden, hidden) → Tanh → Linear(hidden, out)``,
split with ``partition_method="type:Linear"``. Each rank returns the parameters of its own stage,
named as in the PipelineModule (``"<layer index>.<name>"``), which are also the names of the same
layers in a ``torch.nn.Sequential``; :func:`merge_stages` joins the ranks' dicts into one.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import numpy as np
import torch

from .compare import Comparison, compare, dtype_of
from .launch import launch
from .models import ModelSpec, make_batches, mse
from .training import original_functional_linear, pinned_config


@dataclass(frozen=True)
class PipeJob:
    """One pipeline training job. ``micro_batches`` is the pipeline's number of micro-batches per
    ``train_batch`` (DeepSpeed's ``gradient_accumulation_steps``)."""

    steps: int = 2
    micro_batches: int = 2
    micro_batch: int = 4
    stages: int = 2
    dtype: str = "float32"
    zero_stage: int = 0
    lr: float = 0.1
    data_seed: int = 1
    model: ModelSpec = ModelSpec()
    fixes: tuple[str, ...] = ()  # applied in each rank before the engine is built
    reverted: bool = False  # apply ``fixes`` and revert them again before training (checks revert())
    config: dict[str, Any] = field(default_factory=dict)  # merged over pipe_config()

    def with_(self, **changes: Any) -> "PipeJob":
        return replace(self, **changes)

    @property
    def label(self) -> str:
        return (f"ZeRO-{self.zero_stage}, {self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}"
                f" [{self.dtype}]")


@dataclass(frozen=True)
class PipeResult:
    """One rank's (or the reference's) outcome: its parameters and the per-step mean loss."""

    params: dict[str, np.ndarray]
    losses: list[float]
    stage: int = -1


def layers(spec: ModelSpec) -> list[torch.nn.Module]:
    """The model's layers, seeded so every rank and the reference build the same weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return [torch.nn.Linear(spec.in_features, spec.hidden), torch.nn.Tanh(),
                torch.nn.Linear(spec.hidden, spec.hidden), torch.nn.Tanh(),
                torch.nn.Linear(spec.hidden, spec.out_features)]


def pipe_config(job: PipeJob) -> dict[str, Any]:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": job.micro_batch,
        "gradient_accumulation_steps": job.micro_batches,
        "train_batch_size": job.micro_batch * job.micro_batches,  # one data-parallel replica
        "zero_optimization": {"stage": job.zero_stage},
        **pinned_config(dtype_of(job.dtype)),
    }
    config.update(job.config)
    return config


def _data(job: PipeJob, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = make_batches(job.model, job.steps, job.micro_batches, 1, job.micro_batch, job.data_seed)
    return [batches.micro(step, micro, 0) for micro in range(job.micro_batches)]


def train_pipeline(job: PipeJob) -> PipeResult:
    """One rank of ``job`` through ``deepspeed.pipe.PipelineModule`` (after :func:`fixes.harness.setup`;
    run it with ``launch(train_pipeline, job.stages, job)``). Returns this stage's parameters."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import fixes

    if job.fixes:
        fixes.apply(*job.fixes)
        if job.reverted:
            fixes.revert(*job.fixes)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != job.stages:
        raise ValueError(f"the job has {job.stages} stages but runs on {world_size} ranks (one replica per stage)")
    dtype = dtype_of(job.dtype)
    module = PipelineModule(layers(job.model), num_stages=job.stages, loss_fn=mse, partition_method="type:Linear")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=job.lr),
                                           config=pipe_config(job))
    device = engine.device
    losses = []
    for step in range(job.steps):
        data = [(x.to(device, dtype), y.to(device)) for x, y in _data(job, step)]
        losses.append(float(engine.train_batch(data_iter=iter(data))))
    params = {name: p.detach().float().cpu().numpy().copy() for name, p in module.named_parameters()}
    return PipeResult(params, losses, engine.stage_id)


def train_sequential(job: PipeJob) -> PipeResult:
    """The plain-PyTorch reference: the same layers as a ``torch.nn.Sequential``, each micro-batch's
    loss divided by the number of micro-batches (as the pipeline engine documents), one SGD step
    per batch. Low-precision dtypes keep fp32 master weights, like DeepSpeed's optimizers."""
    dtype = dtype_of(job.dtype)
    with original_functional_linear():
        master = torch.nn.Sequential(*layers(job.model))
        work = copy.deepcopy(master).to(dtype)
        with torch.no_grad():
            for param, copy_ in zip(master.parameters(), work.parameters()):
                param.copy_(copy_.float())
        optimizer = torch.optim.SGD(master.parameters(), lr=job.lr)
        losses = []
        for step in range(job.steps):
            optimizer.zero_grad()
            total = 0.0
            for x, y in _data(job, step):
                loss = mse(work(x.to(dtype)), y) / job.micro_batches
                grads = torch.autograd.grad(loss, list(work.parameters()))
                for param, grad in zip(master.parameters(), grads):
                    param.grad = grad.float() + (param.grad if param.grad is not None else 0)
                total += loss.item()
            losses.append(total)
            optimizer.step()
            with torch.no_grad():
                for param, copy_ in zip(master.parameters(), work.parameters()):
                    copy_.copy_(param)
        params = {name: p.detach().float().numpy().copy() for name, p in work.named_parameters()}
    return PipeResult(params, losses)


def merge_stages(results: list[PipeResult]) -> dict[str, np.ndarray]:
    """The whole model's parameters from every stage's rank (each holds only its layers)."""
    merged: dict[str, np.ndarray] = {}
    for result in results:
        overlap = merged.keys() & result.params.keys()
        if overlap:
            raise ValueError(f"stages share parameters {sorted(overlap)}")
        merged.update(result.params)
    return dict(sorted(merged.items()))


def train_pipelines(jobs: Sequence[PipeJob]) -> list[PipeResult]:
    """Rank function: several jobs one after the other in this rank (one rank start-up for all)."""
    return [train_pipeline(job) for job in jobs]


def run_pipelines(jobs: Sequence[PipeJob], timeout: float) -> list[dict[str, np.ndarray]]:
    """Train ``jobs`` (same number of stages) through the pipeline engine on fresh ranks; the whole
    model's parameters per job. A hang raises RankTimeoutError after ``timeout`` seconds."""
    stages = {job.stages for job in jobs}
    if len(stages) != 1:
        raise ValueError(f"jobs with different numbers of stages ({sorted(stages)}) cannot share ranks")
    per_rank = launch(train_pipelines, stages.pop(), list(jobs), timeout=timeout)
    return [merge_stages([results[index] for results in per_rank]) for index in range(len(jobs))]


@dataclass(frozen=True)
class PipeVersus:
    """A pipeline job against plain PyTorch; ``comparison`` is None when the pipeline did not train
    (``outcome`` says what happened instead)."""

    job: PipeJob
    comparison: Comparison | None
    outcome: str = "trained"

    @property
    def close(self) -> bool:
        return self.comparison is not None and self.comparison.close

    def row(self) -> dict[str, str]:
        diff = "–" if self.comparison is None else f"{self.comparison.max_abs_diff:.3e}"
        verdict = "–" if self.comparison is None else "yes" if self.comparison.close else "NO"
        return {"configuration": self.job.label, "pipeline engine": self.outcome[:90],
                "max |Δparam| vs plain PyTorch": diff, "within dtype tolerance": verdict}


def versus_sequential(job: PipeJob, params: dict[str, np.ndarray] | None, outcome: str = "trained") -> PipeVersus:
    """Compare a pipeline run's parameters (None: it did not train) with :func:`train_sequential`."""
    if params is None:
        return PipeVersus(job, None, outcome)
    return PipeVersus(job, compare(params, train_sequential(job).params, job.dtype, f"{job.label}: parameters"), outcome)


@dataclass(frozen=True)
class StageRow:
    """One stage of one job against plain PyTorch: how large its update is, and how far its parameters are."""

    job: PipeJob
    stage: int
    ratio: float  # |pipeline's update| / |plain PyTorch's update| for this stage's parameters
    max_abs_diff: float  # this stage's parameters against plain PyTorch's after the step(s)

    def row(self) -> dict[str, str]:
        return {"configuration": self.job.label, "stage": str(self.stage),
                "update / plain PyTorch's": f"{self.ratio:.4f}", "max |Δparam|": f"{self.max_abs_diff:.3e}"}


def initial_params(job: PipeJob) -> dict[str, np.ndarray]:
    """The parameters before training (the same for every stage's rank and for plain PyTorch)."""
    return {name: p.detach().numpy().copy() for name, p in torch.nn.Sequential(*layers(job.model)).named_parameters()}


def update_ratio(params: dict[str, np.ndarray], reference: dict[str, np.ndarray], initial: dict[str, np.ndarray],
                 names: list[str]) -> float:
    """|update of ``params``| / |update of ``reference``| over ``names``: with one SGD step, the ratio of the gradients."""
    moved = np.concatenate([(params[n] - initial[n]).ravel() for n in names])
    expected = np.concatenate([(reference[n] - initial[n]).ravel() for n in names])
    return float(np.linalg.norm(moved) / np.linalg.norm(expected))


def measure_stages(jobs: list[PipeJob], timeout: float = 240) -> list[StageRow]:
    """Run ``jobs`` (same number of stages) through the pipeline engine on fresh ranks (fixes applied in
    this process are applied in the ranks too) and compare each stage with plain PyTorch; rows by job,
    then by stage."""
    per_rank: list[list[PipeResult]] = launch(train_pipelines, jobs[0].stages, list(jobs), timeout=timeout)
    rows = []
    for index, job in enumerate(jobs):
        reference, initial = train_sequential(job).params, initial_params(job)
        for result in sorted((results[index] for results in per_rank), key=lambda r: r.stage):
            names = sorted(result.params)
            diff = max(float(np.abs(result.params[n] - reference[n]).max()) for n in names)
            rows.append(StageRow(job, result.stage, update_ratio(result.params, reference, initial, names), diff))
    return rows


def pipeline_script(config: dict[str, Any], steps: int) -> dict[str, Any]:
    """One rank of a user's pipeline training script (what the ``deepspeed`` launcher starts on each
    rank): the layers split into two stages by ``PipelineModule``, ``deepspeed.initialize`` with
    ``config``, then ``steps`` calls of ``engine.train_batch`` over ``gradient_accumulation_steps``
    micro-batches. Returns this stage's trained parameters (the same job as
    ``train_pipeline(PipeJob(...))``, whose config ``pipe_config`` gives)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    module = PipelineModule(layers(ModelSpec()), num_stages=2, loss_fn=mse, partition_method="type:Linear")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                           config=config)
    micro_batches = config["gradient_accumulation_steps"]
    batches = make_batches(ModelSpec(), steps, micro_batches)
    for step in range(steps):
        data = [tuple(t.to(engine.device) for t in batches.micro(step, micro, 0)) for micro in range(micro_batches)]
        engine.train_batch(data_iter=iter(data))
    return {name: p.detach().float().cpu().numpy().copy() for name, p in module.named_parameters()}


def train_without_pipeline(job: PipeJob) -> dict:
    """``job`` without the pipeline: the same layers as one ``torch.nn.Sequential`` through ``deepspeed.initialize``
    with the same config in this process (one rank), ``engine.backward`` and ``engine.step`` per micro-batch, on
    the same micro-batches. Returns the trained parameters, named as the pipeline's."""
    import deepspeed
    import torch

    from .models import make_batches, mse
    from .env import device

    model = torch.nn.Sequential(*layers(job.model))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=job.lr),
                                           config=pipe_config(job))
    batches = make_batches(job.model, job.steps, job.micro_batches, 1, job.micro_batch, job.data_seed)
    for step in range(job.steps):
        for micro in range(job.micro_batches):
            x, y = batches.micro(step, micro, 0)
            engine.backward(mse(engine(x.to(device())), y.to(device())))
            engine.step()
    return {name: p.detach().float().cpu().numpy().copy() for name, p in model.named_parameters()}
