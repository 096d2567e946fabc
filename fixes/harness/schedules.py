"""One job with an LR scheduler and two parameter groups, run through a DeepSpeed engine and in plain PyTorch,
recording the learning rate every group used at every optimizer step.

The groups are the split Hugging Face's Trainer makes: group 0 holds the weight matrices (weight decay), group 1
the biases (no weight decay). Each group may have its own base LR. DeepSpeed builds the scheduler from the
config's ``"scheduler"`` section and steps it inside ``engine.step()`` after the optimizer step; the plain
reference is ``torch.optim.AdamW`` with ``torch.optim.lr_scheduler.LambdaLR`` stepped the same way, with one
multiplier function per group (the documented formula of the DeepSpeed schedule, written by the entry).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .env import device
from .models import TinyMLP, make_batches, mse
from .training import Job, ds_config, gathered_params

WEIGHT_DECAY = 0.01


@dataclass(frozen=True)
class ScheduledJob:
    """``scheduler`` is the DeepSpeed config's ``"scheduler"`` section; ``group_lrs`` the base LR of the
    weights' group and of the biases' group."""

    scheduler: dict[str, Any]
    group_lrs: tuple[float, float] = (1e-2, 1e-2)
    steps: int = 6
    zero_stage: int = 0
    fixes: tuple[str, ...] = ()  # applied before the engine is built

    @property
    def job(self) -> Job:
        """The harness job it runs (model, data, pinned config), with AdamW's first group LR."""
        return Job(zero_stage=self.zero_stage, steps=self.steps, optimizer="adam", lr=self.group_lrs[0],
                   fixes=self.fixes, config={"scheduler": self.scheduler})

    @property
    def config(self) -> dict[str, Any]:
        return ds_config(self.job)


@dataclass(frozen=True)
class ScheduledRun:
    """``lrs[step][group]``: the LR each group used at each optimizer step; ``params`` after the last step."""

    lrs: list[list[float]]
    params: dict[str, np.ndarray]
    losses: list[float] = field(default_factory=list)

    def lrs_of(self, group: int) -> np.ndarray:
        return np.array([step[group] for step in self.lrs], dtype=np.float64)


def param_groups(model: torch.nn.Module, group_lrs: Sequence[float]) -> list[dict[str, Any]]:
    """Weights (with decay) and biases (without), the decay/no-decay split of Hugging Face's Trainer."""
    weights = [p for name, p in model.named_parameters() if not name.endswith("bias")]
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    return [{"params": weights, "lr": group_lrs[0], "weight_decay": WEIGHT_DECAY},
            {"params": biases, "lr": group_lrs[1], "weight_decay": 0.0}]


def _lr(value: Any) -> float:
    return float(value.item() if torch.is_tensor(value) else value)


def train_deepspeed_scheduled(job: ScheduledJob) -> ScheduledRun:
    """``deepspeed.initialize`` with a torch AdamW over the two groups and ``job.scheduler`` in the config,
    then ``engine.backward`` / ``engine.step`` for ``job.steps`` steps."""
    import deepspeed

    import fixes

    if job.fixes:
        fixes.apply(*job.fixes)
    model = TinyMLP(job.job.model)
    optimizer = torch.optim.AdamW(param_groups(model, job.group_lrs))
    engine, _, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, config=job.config)
    if scheduler is None:
        raise AssertionError(f"deepspeed.initialize built no LR scheduler from {job.scheduler}")
    batches = make_batches(job.job.model, steps=job.steps)
    lrs, losses = [], []
    for step in range(job.steps):
        lrs.append([_lr(group["lr"]) for group in optimizer.param_groups])  # what this step's update uses
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device())), y.to(device()))
        engine.backward(loss)
        engine.step()  # optimizer step, then the scheduler's step
        losses.append(loss.item())
    return ScheduledRun(lrs, gathered_params(engine.module), losses)


def train_reference_scheduled(job: ScheduledJob, multipliers: Sequence[Callable[[int], float]]) -> ScheduledRun:
    """The same job in plain PyTorch: AdamW over the same groups, ``LambdaLR(optimizer, multipliers)`` (one
    function per group, of the number of scheduler steps taken so far), stepped after each optimizer step."""
    model = TinyMLP(job.job.model)
    optimizer = torch.optim.AdamW(param_groups(model, job.group_lrs))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, list(multipliers))
    batches = make_batches(job.job.model, steps=job.steps)
    lrs, losses = [], []
    for step in range(job.steps):
        lrs.append([_lr(group["lr"]) for group in optimizer.param_groups])
        x, y = batches.micro(step, 0, 0)
        loss = mse(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return ScheduledRun(lrs, {k: v.detach().cpu().numpy().copy() for k, v in model.named_parameters()}, losses)


def lr_table(runs: dict[str, ScheduledRun]) -> list[dict[str, Any]]:
    """Rows for :func:`fixes.harness.print_table`: per step, each run's LR of each group."""
    steps = len(next(iter(runs.values())).lrs)
    rows = []
    for step in range(steps):
        row: dict[str, Any] = {"step": step}
        for label, run in runs.items():
            for group, lr in enumerate(run.lrs[step]):
                row[f"{label} g{group}"] = f"{lr:.3e}"
        rows.append(row)
    return rows
