"""``deepspeed.zero.GatheredParameters`` over a whole ZeRO-3 model, after every training step.

What a script does to log, average or save the full weights while it trains. Each step the rank
gathers all parameters at once (one ``GatheredParameters`` over the list: DeepSpeed's coalesced
path) and again one parameter at a time (the synchronous path), and compares the two copies. The
parameters change every step, so a gathered buffer that was never written cannot pass for the right
values by holding last step's.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...harness.models import make_batches, mse
from ...harness.training import Job


def gather_job(**changes: Any) -> Job:
    """ZeRO-3 built inside ``deepspeed.zero.Init`` (parameters partitioned across the ranks), SGD,
    many short steps: each step is one chance for the race."""
    return Job(zero_stage=3, zero3_init=True, steps=200, config={"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


@dataclass(frozen=True)
class GatherRun:
    """One rank's record: the steps whose all-at-once gather differed from the one-at-a-time
    gather, the largest such difference, and the last all-at-once gather (full parameters)."""

    rank: int
    steps: int
    corrupt_steps: tuple[int, ...]
    max_abs_diff: float  # the largest finite difference
    nonfinite: int  # corrupt steps where the difference was NaN or inf
    params: dict[str, np.ndarray]

    @property
    def corrupt(self) -> int:
        return len(self.corrupt_steps)

    def __str__(self) -> str:
        return (f"rank {self.rank}: {self.corrupt} of {self.steps} all-at-once gathers differed from the "
                f"one-at-a-time gather (largest finite difference {self.max_abs_diff:.3e}; NaN/inf in "
                f"{self.nonfinite})")


def gather_every_step(job: Job) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): train ``job``; after each step gather the whole
    model both ways and compare. ``job.fixes`` are applied before the engine is built."""
    import deepspeed

    from ...zero3 import gathered_parameters
    from ...harness.env import device
    from ...harness.training import build_engine

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    engine = build_engine(job)
    params = dict(engine.module.named_parameters())
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)
    corrupt: list[int] = []
    largest = 0.0  # the largest finite difference; garbage can also be NaN or inf
    nonfinite = 0
    together: dict[str, torch.Tensor] = {}
    for step in range(job.steps):
        x, y = batches.micro(step, 0, rank)
        engine.backward(mse(engine(x.to(device())), y.to(device())))
        engine.step()
        with deepspeed.zero.GatheredParameters(list(params.values())):
            together = {name: p.detach().clone() for name, p in params.items()}
        with gathered_parameters(engine.module) as one_by_one:
            apart = {name: p.clone() for name, p in one_by_one.items()}
        differences = [float((together[name] - apart[name]).abs().max()) for name in params]
        if any(d != 0 for d in differences):  # exact: both copies come from the same partitions (NaN != 0 too)
            corrupt.append(step)
            nonfinite += not all(np.isfinite(differences))
            largest = max([largest, *(d for d in differences if np.isfinite(d))])
    return {"corrupt_steps": np.array(corrupt, dtype=np.int64), "max_abs_diff": np.array(largest),
            "nonfinite": np.array(nonfinite), "params": together}


def run_gather_race(job: Job, world_size: int = 2, timeout: float = 300) -> list[GatherRun]:
    """:func:`gather_every_step` on ``world_size`` fresh ranks; one :class:`GatherRun` per rank."""
    from ...harness.launch import launch

    if world_size < 2:
        raise ValueError("the race needs at least 2 ranks: with one, nothing is gathered")
    results = launch(gather_every_step, world_size, job, timeout=timeout)
    return [GatherRun(rank, job.steps, tuple(int(s) for s in result["corrupt_steps"]),
                      float(result["max_abs_diff"]), int(result["nonfinite"]), result["params"])
            for rank, result in enumerate(results)]


def run_until_corrupt(job: Job, attempts: int = 3, world_size: int = 2, timeout: float = 300) -> list[list[GatherRun]]:
    """:func:`run_gather_race` up to ``attempts`` times, stopping after the first attempt in which any
    rank saw a corrupt gather. The race is timing-dependent: on an affected release one attempt of
    200 steps usually shows it, but a machine with other timings may need more.
    Returns every attempt's runs, the last one last."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    tried: list[list[GatherRun]] = []
    for _ in range(attempts):
        tried.append(run_gather_race(job, world_size, timeout))
        if any(run.corrupt for run in tried[-1]):
            break
    return tried


__all__ = ["GatherRun", "gather_every_step", "gather_job", "run_gather_race", "run_until_corrupt"]
