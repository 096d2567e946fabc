"""How pipeline-grad-accum-sums is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied, and ``measure`` (the
shared :func:`~fixes.harness.pipeline.measure_stages`), the per-stage table the notebook prints.
Imported by the sweep, the tests and the notebook, never by the fix or its probe.

The measure is the size of each stage's one-step SGD update against plain PyTorch's (the same layers as a
``torch.nn.Sequential``, each micro-batch's loss divided by the number of micro-batches): with one step,
the update is ``lr * gradient``, so the ratio is the ratio of the gradients. Summed micro-batches give
``gradient_accumulation_steps``; averaged ones give 1.
"""
from __future__ import annotations

from ...harness.pipeline import (PipeJob, train_without_pipeline, StageRow, initial_params, pipe_config, run_pipelines, train_sequential,
                                 update_ratio)
from ...harness.pipeline import measure_stages as measure
from ...harness.pipeline import pipeline_script as user_script

__all__ = ["reproduce", "measure", "user_script", "StageRow", "PipeJob", "GAS", "initial_params", "update_ratio",
           "pipe_config", "run_pipelines", "train_sequential"]  # the notebook's names

GAS = 4  # gradient_accumulation_steps: the pipeline's micro-batches per train_batch


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


def verdict(last_ratio: float, gas: int) -> bool:
    """The sweep's check for any ``gas``: True when the last stage's update is ``gas`` times plain PyTorch's
    (summed, gas > 1), False when it is plain PyTorch's (averaged). CannotTellError otherwise."""
    from ...exceptions import CannotTellError

    if abs(last_ratio - 1) < 1e-3:
        return False
    if gas > 1 and abs(last_ratio - gas) < 1e-3 * gas:
        return True
    raise CannotTellError(f"the last stage's update is {last_ratio:.4f} x plain PyTorch's: neither summed ({gas}) "
                          "nor averaged (1)")




def last_layer_ratio_without_pipeline(job: PipeJob) -> float:
    """The update of the model's last Linear (the pipeline's last stage holds it) against plain PyTorch's, for
    :func:`train_without_pipeline`."""
    params = train_without_pipeline(job)
    names = sorted(name for name in params if name.startswith("4."))
    return update_ratio(params, train_sequential(job).params, initial_params(job), names)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's 2-stage pipeline (fp32, ZeRO-1, 4 micro-batches,
    one step) on 2 gloo ranks, then 1 micro-batch per step, then the same job without the pipeline (the same layers
    as one module through ``deepspeed.initialize``, ``engine.backward`` per micro-batch, one rank). Each cell is the
    sweep's check: the last stage's (the last Linear's) one-step update against plain PyTorch's, ``gas`` times it
    where the micro-batches are summed. ZeRO-1 as in the sweep: it also trains where pipeline-nested-backward's
    refusal stops ZeRO-0."""
    from ...harness import Cell, trigger_job

    base = PipeJob(steps=1, micro_batches=GAS, zero_stage=1)

    def piped(job: PipeJob) -> bool:
        return verdict(measure([job], timeout=180)[-1].ratio, job.micro_batches)

    def cell(label: str, job: PipeJob, flips: str = "") -> Cell:
        return Cell(label, trigger_job(pipe_config(job), job.stages, uses=["pipeline"]), lambda: piped(job), flips)

    return [cell(f"pipeline, gradient_accumulation_steps {GAS}", base),
            cell("gradient_accumulation_steps 1", base.with_(micro_batches=1), "gradient_accumulation_steps"),
            Cell("the same job without the pipeline (engine.backward per micro-batch)",
                 trigger_job(pipe_config(base), 1),
                 lambda: verdict(last_layer_ratio_without_pipeline(base), base.micro_batches), "uses:pipeline")]
