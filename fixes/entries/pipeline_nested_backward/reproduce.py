"""How pipeline-nested-backward is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from . import _REFUSAL

from .observe import RankOutcome, observe_ranks
from .pipeline import (PipeJob, PipeResult, PipeVersus, run_pipelines, train_pipeline,
                       train_sequential, versus_sequential)

__all__ = ["reproduce", "RankOutcome", "observe_ranks", "PipeJob", "PipeResult", "PipeVersus", "run_pipelines",
           "train_pipeline", "train_sequential", "versus_sequential"]  # the notebook's names


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
