"""How pipeline-nested-backward is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. ``user_script()`` (the shared :func:`~fixes.harness.pipeline.pipeline_script`) is the
user's pipeline training script the notebook runs on two ranks."""
from __future__ import annotations

from . import _REFUSAL

from .observe import RankOutcome, observe_ranks
from ...harness.pipeline import (PipeJob, PipeResult, PipeVersus, pipe_config, run_pipelines, train_pipeline,
                                 train_sequential, versus_sequential)
from ...harness.pipeline import pipeline_script as user_script

__all__ = ["reproduce", "user_script", "RankOutcome", "observe_ranks", "PipeJob", "PipeResult", "PipeVersus",
           "pipe_config", "run_pipelines", "train_pipeline", "train_sequential", "versus_sequential"]  # the notebook's names


def reproduce() -> bool:
    """Two pipeline stages (ZeRO-0, fp32, 2 micro-batches, 1 step) on 2 gloo ranks, unfixed: True when
    a stage's backward is refused with the RuntimeError above, False when both stages train. Raises
    RankFailedError for any other failure and RankTimeoutError if the ranks hang."""
    from ...exceptions import RankFailedError

    try:
        run_pipelines([PipeJob(steps=1)], timeout=180)
    except RankFailedError as exc:  # launch() stops at the first failing rank and kills the other
        if _REFUSAL in exc.message:
            return True
        raise
    return False


def refused(job: PipeJob) -> bool:
    """The sweep's check for ``job`` on ``job.stages`` gloo ranks: True when a stage's backward is refused with the
    RuntimeError above, False when every stage trains."""
    from ...exceptions import RankFailedError

    try:
        run_pipelines([job], timeout=180)
    except RankFailedError as exc:  # launch() stops at the first failing rank and kills the other
        if _REFUSAL in exc.message:
            return True
        raise
    return False


def refused_without_pipeline(job: PipeJob) -> bool:
    """``job`` without the pipeline: the same layers as one ``torch.nn.Sequential`` through ``deepspeed.initialize``
    with the same config in this process (one rank), ``engine.backward`` and ``engine.step`` per micro-batch. True
    when a backward is refused with the RuntimeError above, False when it trains."""
    import deepspeed
    import torch

    from ...harness import device, make_batches, mse
    from ...harness.pipeline import layers

    model = torch.nn.Sequential(*layers(job.model))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=job.lr),
                                           config=pipe_config(job))
    batches = make_batches(job.model, job.steps, job.micro_batches, 1, job.micro_batch, job.data_seed)
    try:
        for step in range(job.steps):
            for micro in range(job.micro_batches):
                x, y = batches.micro(step, micro, 0)
                engine.backward(mse(engine(x.to(device())), y.to(device())))
                engine.step()
    except RuntimeError as exc:
        if _REFUSAL in str(exc):
            return True
        raise
    return False


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's 2-stage pipeline (ZeRO-0, fp32, 2 micro-batches,
    one step) on 2 gloo ranks, then ZeRO-1 (a ZeRO optimizer: the hooks accept a backward engine.backward did not
    start), then the same job without the pipeline (the same layers as one module through ``deepspeed.initialize``,
    ``engine.backward`` per micro-batch, one rank). Each cell tells whether a backward is refused. The ZeRO-1 cell
    trains with pipeline-stages-divide-by-gas-twice's too small first-stage update, which this check does not read."""
    from ...harness import Cell, trigger_job

    base = PipeJob(steps=1)

    def cell(label: str, job: PipeJob, flips: str = "") -> Cell:
        return Cell(label, trigger_job(pipe_config(job), job.stages, uses=["pipeline"]), lambda: refused(job), flips)

    return [cell("pipeline, ZeRO stage 0", base),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            Cell("the same job without the pipeline (engine.backward per micro-batch)",
                 trigger_job(pipe_config(base), 1), lambda: refused_without_pipeline(base), "uses:pipeline")]
