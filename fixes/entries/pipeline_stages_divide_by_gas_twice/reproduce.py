"""How pipeline-stages-divide-by-gas-twice is reproduced: the fast check the release sweep runs (``reproduce()``:
True where the bug shows), with no fix applied, and ``measure`` (the
shared :func:`~fixes.harness.pipeline.measure_stages`), the per-stage table the notebook prints.
Imported by the sweep, the tests and the notebook, never by the fix or its probe.

The measure is the size of each stage's one-step SGD update against plain PyTorch's (the same layers as a
``torch.nn.Sequential``, each micro-batch's loss divided by the number of micro-batches): with one step the
update is ``lr * gradient``, so the ratio is the ratio of the gradients. Where the bug is, the last stage's
ratio is 1 and the stage before it gets ``1 / gradient_accumulation_steps``.
"""
from __future__ import annotations

from ...harness.pipeline import (PipeJob, train_without_pipeline, StageRow, initial_params, pipe_config, run_pipelines, train_sequential,
                                 update_ratio)
from ...harness.pipeline import measure_stages as measure
from ...harness.pipeline import pipeline_script as user_script

__all__ = ["reproduce", "measure", "user_script", "StageRow", "PipeJob", "GAS", "initial_params", "update_ratio",
           "pipe_config", "run_pipelines", "train_sequential"]  # the notebook's names

GAS = 4  # gradient_accumulation_steps: the pipeline's micro-batches per train_batch


def verdict(rows: list[StageRow]) -> bool:
    """For one job's rows (stage 0, then the last stage): True when the first stage's update is
    1/gas of the last stage's (divided once more), False when the two agree. CannotTellError otherwise."""
    from ...exceptions import CannotTellError

    first, last = rows[0], rows[-1]
    gas = first.job.micro_batches
    if abs(first.ratio * gas - last.ratio) < 1e-3 * last.ratio:
        return True
    if abs(first.ratio - last.ratio) < 1e-3 * last.ratio:
        return False
    raise CannotTellError(f"stage 0's update is {first.ratio:.4f} x plain PyTorch's and the last stage's "
                          f"{last.ratio:.4f} x: neither 1/{gas} of it (divided twice) nor the same")


def reproduce() -> bool:
    """A 2-stage pipeline (fp32, ZeRO-1, gradient_accumulation_steps=4, one step) on 2 gloo ranks, unfixed:
    True when stage 0's update is 1/4 of the last stage's (against plain PyTorch: 0.25 and 1), False when
    the two stages agree (both 1; or both 4 where pipeline-grad-accum-sums sums the micro-batches). ZeRO-1,
    not ZeRO-0: it also trains where pipeline-nested-backward's refusal stops ZeRO-0 (0.18.3, 0.18.4).
    Raises CannotTellError for any other pair of ratios."""
    return verdict(measure([PipeJob(steps=1, micro_batches=GAS, zero_stage=1)], timeout=180))


def ratios_verdict(first: float, last: float, gas: int) -> bool:
    """:func:`verdict` for any ``gas`` (1 included, where dividing once more changes nothing): True when the first
    stage's update is ``1/gas`` of the last stage's (gas > 1), False when the two agree. CannotTellError
    otherwise."""
    from ...exceptions import CannotTellError

    if abs(first - last) < 1e-3 * last:
        return False
    if gas > 1 and abs(first * gas - last) < 1e-3 * last:
        return True
    raise CannotTellError(f"the first stage's update is {first:.4f} x plain PyTorch's and the last stage's "
                          f"{last:.4f} x: neither 1/{gas} of it (divided twice) nor the same")




def without_pipeline(job: PipeJob) -> bool:
    """The check on :func:`train_without_pipeline`: the first Linear's update (the pipeline's first stage holds
    it) against the last Linear's (the last stage's), each as a multiple of plain PyTorch's."""
    params, reference, initial = train_without_pipeline(job), train_sequential(job).params, initial_params(job)

    def ratio(prefix: str) -> float:
        return update_ratio(params, reference, initial, sorted(n for n in params if n.startswith(prefix)))

    return ratios_verdict(ratio("0."), ratio("4."), job.micro_batches)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's 2-stage pipeline (fp32, ZeRO-1, 4 micro-batches,
    one step) on 2 gloo ranks, then 1 micro-batch per step, then the same job without the pipeline (the same layers
    as one module through ``deepspeed.initialize``, ``engine.backward`` per micro-batch, one rank). Each cell is the
    sweep's check: the first stage's (the first Linear's) one-step update against the last stage's (the last
    Linear's), each against plain PyTorch. ZeRO-1 as in the sweep: it also trains where pipeline-nested-backward's
    refusal stops ZeRO-0."""
    from ...harness import Cell, trigger_job

    base = PipeJob(steps=1, micro_batches=GAS, zero_stage=1)

    def piped(job: PipeJob) -> bool:
        rows = measure([job], timeout=180)
        return ratios_verdict(rows[0].ratio, rows[-1].ratio, job.micro_batches)

    def cell(label: str, job: PipeJob, flips: str = "") -> Cell:
        return Cell(label, trigger_job(pipe_config(job), job.stages, uses=["pipeline"]), lambda: piped(job), flips)

    return [cell(f"pipeline, gradient_accumulation_steps {GAS}", base),
            cell("gradient_accumulation_steps 1", base.with_(micro_batches=1), "gradient_accumulation_steps"),
            Cell("the same job without the pipeline (engine.backward per micro-batch)",
                 trigger_job(pipe_config(base), 1), lambda: without_pipeline(base), "uses:pipeline")]
