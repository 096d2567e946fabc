"""How pipeline-grad-accum-sums is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied, and :func:`measure`, the per-stage table the notebook prints.
Imported by the sweep, the tests and the notebook, never by the fix or its probe.

The measure is the size of each stage's one-step SGD update against plain PyTorch's (the same layers as a
``torch.nn.Sequential``, each micro-batch's loss divided by the number of micro-batches): with one step,
the update is ``lr * gradient``, so the ratio is the ratio of the gradients. Summed micro-batches give
``gradient_accumulation_steps``; averaged ones give 1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...harness.launch import launch
from ...harness.pipeline import (PipeJob, PipeResult, layers, pipe_config, run_pipelines, train_pipelines,
                                train_sequential)

__all__ = ["reproduce", "measure", "user_script", "StageRow", "PipeJob", "GAS", "initial_params", "update_ratio",
           "pipe_config", "run_pipelines", "train_sequential"]  # the notebook's names

GAS = 4  # gradient_accumulation_steps: the pipeline's micro-batches per train_batch


@dataclass(frozen=True)
class StageRow:
    job: PipeJob
    stage: int
    ratio: float  # |pipeline's update| / |plain PyTorch's update| for this stage's parameters
    max_abs_diff: float  # this stage's parameters against plain PyTorch's after the step(s)

    def row(self) -> dict[str, str]:
        return {"configuration": self.job.label, "stage": str(self.stage),
                "update / plain PyTorch's": f"{self.ratio:.3f}", "max |Δparam|": f"{self.max_abs_diff:.3e}"}


def initial_params(job: PipeJob) -> dict[str, np.ndarray]:
    import torch

    return {name: p.detach().numpy().copy() for name, p in torch.nn.Sequential(*layers(job.model)).named_parameters()}


def update_ratio(params: dict[str, np.ndarray], reference: dict[str, np.ndarray], initial: dict[str, np.ndarray],
                 names: list[str]) -> float:
    moved = np.concatenate([(params[n] - initial[n]).ravel() for n in names])
    expected = np.concatenate([(reference[n] - initial[n]).ravel() for n in names])
    return float(np.linalg.norm(moved) / np.linalg.norm(expected))


def measure(jobs: list[PipeJob], timeout: float = 240) -> list[StageRow]:
    """Run ``jobs`` (same number of stages) through the pipeline engine on fresh ranks (fixes applied in
    this process are applied in the ranks too) and compare each stage with plain PyTorch."""
    per_rank: list[list[PipeResult]] = launch(train_pipelines, jobs[0].stages, list(jobs), timeout=timeout)
    rows = []
    for index, job in enumerate(jobs):
        reference, initial = train_sequential(job).params, initial_params(job)
        for result in sorted((results[index] for results in per_rank), key=lambda r: r.stage):
            names = sorted(result.params)
            diff = max(float(np.abs(result.params[n] - reference[n]).max()) for n in names)
            rows.append(StageRow(job, result.stage, update_ratio(result.params, reference, initial, names), diff))
    return rows


def reproduce() -> bool:
    """A 2-stage pipeline (fp32, ZeRO-1, gradient_accumulation_steps=4, one step) on 2 gloo ranks, unfixed:
    True when the last stage's update is GAS times plain PyTorch's (the micro-batches summed), False when it
    is plain PyTorch's (averaged). ZeRO-1, not ZeRO-0: it also trains where pipeline-nested-backward's refusal
    stops ZeRO-0 (0.18.3, 0.18.4). Raises CannotTellError for any other ratio."""
    from ...exceptions import CannotTellError

    rows = measure([PipeJob(steps=1, micro_batches=GAS, zero_stage=1)], timeout=180)
    last = rows[-1]
    if abs(last.ratio - GAS) < 1e-3 * GAS:
        return True
    if abs(last.ratio - 1) < 1e-3:
        return False
    raise CannotTellError(f"the last stage's update is {last.ratio:.4f} x plain PyTorch's: neither summed ({GAS}) "
                          "nor averaged (1)")


def user_script(config: dict[str, Any], steps: int) -> dict[str, Any]:
    """One rank of a user's pipeline training script (what the ``deepspeed`` launcher starts on each
    rank): the layers split into two stages by ``PipelineModule``, ``deepspeed.initialize`` with
    ``config``, then ``steps`` calls of ``engine.train_batch`` over ``gradient_accumulation_steps``
    micro-batches. Returns this stage's trained parameters (the same job as
    ``train_pipeline(PipeJob(...))``, whose config ``pipe_config`` gives)."""
    import deepspeed
    import torch
    from deepspeed.pipe import PipelineModule

    from ...harness import ModelSpec, make_batches, mse

    module = PipelineModule(layers(ModelSpec()), num_stages=2, loss_fn=mse, partition_method="type:Linear")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                                           config=config)
    micro_batches = config["gradient_accumulation_steps"]
    batches = make_batches(ModelSpec(), steps, micro_batches)
    for step in range(steps):
        data = [tuple(t.to(engine.device) for t in batches.micro(step, micro, 0)) for micro in range(micro_batches)]
        engine.train_batch(data_iter=iter(data))  # the micro-batches' gradients are summed where the bug is
    return {name: p.detach().float().cpu().numpy().copy() for name, p in module.named_parameters()}
