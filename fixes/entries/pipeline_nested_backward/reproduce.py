"""How pipeline-nested-backward is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. ``user_script()`` is the user's pipeline training script the notebook runs on two ranks."""
from __future__ import annotations

from typing import Any

from . import _REFUSAL

from .observe import RankOutcome, observe_ranks
from ...harness.pipeline import (PipeJob, PipeResult, PipeVersus, layers, pipe_config, run_pipelines, train_pipeline,
                       train_sequential, versus_sequential)

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
        engine.train_batch(data_iter=iter(data))  # the first stage's backward is refused where the bug is
    return {name: p.detach().float().cpu().numpy().copy() for name, p in module.named_parameters()}
