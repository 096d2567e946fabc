"""Training a job that may crash: its result, or the exact error and where it was raised.

For tables whose rows are either a silent wrong result or a crash: :func:`attempt` never raises for
the job's own failure; it records ``KeyError: 0``, the training-loop call that raised it (e.g.
``engine.step()``) and the innermost DeepSpeed function it came from. :func:`attempt_all` runs a
list of jobs in one rank, for :func:`fixes.harness.launch` (one process start for a whole table).
"""
from __future__ import annotations

import os
import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Sequence

from ...harness.training import Job, TrainResult, train_deepspeed

_TRAINING_FILE = os.path.join("fixes", "harness", "training.py")
_DEEPSPEED_DIR = os.sep + "deepspeed" + os.sep


@dataclass(frozen=True)
class Attempt:
    """One job's outcome: ``result`` when it trained, else ``error`` ("KeyError: 0"), ``call`` (the
    training-loop line that raised, e.g. "engine.step()") and ``raised_in`` (the innermost DeepSpeed
    function on the traceback, e.g. "deepspeed/runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.step")."""

    job: Job
    result: TrainResult | None = None
    error: str = ""
    call: str = ""
    raised_in: str = ""

    @property
    def ok(self) -> bool:
        return self.result is not None

    def __str__(self) -> str:
        if self.ok:
            return "trained"
        where = f" at {self.call}" if self.call else ""
        inside = f" (in {self.raised_in})" if self.raised_in else ""
        return f"{self.error}{where}{inside}"


def attempt(job: Job) -> Attempt:
    """Train ``job`` in this process (after :func:`fixes.harness.setup`); an exception becomes the
    Attempt's error instead of propagating."""
    try:
        return Attempt(job, result=train_deepspeed(job))
    except Exception as exc:  # noqa: BLE001 - the error is the finding
        call, raised_in = _locate(exc.__traceback__)
        return Attempt(job, error=f"{type(exc).__name__}: {exc}", call=call, raised_in=raised_in)


def attempt_all(jobs: Sequence[Job]) -> list[Attempt]:
    """Rank entry point for :func:`fixes.harness.launch`: every job, one after the other."""
    return [attempt(job) for job in jobs]


def _locate(tb: TracebackType | None) -> tuple[str, str]:
    call, raised_in = "", ""
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(_TRAINING_FILE):
            call = (traceback.extract_tb(tb, limit=1)[0].line or "").strip()
            call = call.split(" = ", 1)[-1]  # "loss = _backward(...)" -> "_backward(...)"
        elif _DEEPSPEED_DIR in code.co_filename:
            path = code.co_filename[code.co_filename.rindex(_DEEPSPEED_DIR) + 1:]
            raised_in = f"{path} {getattr(code, 'co_qualname', code.co_name)}"
        tb = tb.tb_next
    return call, raised_in
