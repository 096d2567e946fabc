"""One job trained with ``engine.backward(loss)`` and with direct backward calls on the engine's
outputs (``Job.backward``), and what each direct call did compared with ``engine.backward``.

A direct backward can train to the same parameters ("same"), to other parameters ("differs"),
crash ("crash": the error and the training-loop call that raised it), or be refused at the
backward call with DeepSpeed's (or a fix's) "Direct calls to tensor.backward() are not supported"
RuntimeError ("refused"), which is a clear error rather than a wrong result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...exceptions import CannotTellError
from ...harness.compare import compare
from ...harness.training import Job
from .attempts import Attempt, attempt

DIRECT_MODES = ("tensor", "tensor-grad")
REFUSAL = "RuntimeError: Direct calls to tensor.backward() are not supported in this configuration"
_CALLS = {"tensor": "loss.backward()", "tensor-grad": "out.backward(grad)"}


@dataclass(frozen=True)
class Outcome:
    kind: str  # "same", "differs", "crash" or "refused"
    text: str  # for a table cell
    max_abs_diff: float | None = None  # against engine.backward, when both trained

    @property
    def shows_bug(self) -> bool:
        """A wrong result or a crash; a refusal at the backward call is not this bug."""
        return self.kind in ("differs", "crash")


@dataclass(frozen=True)
class BackwardModes:
    """``job`` through ``engine.backward`` (``engine``) and through each direct mode (``direct``)."""

    label: str
    job: Job
    engine: Attempt
    direct: dict[str, Attempt]

    def outcome(self, mode: str) -> Outcome:
        run = self.direct[mode]
        if not run.ok:
            if run.error.startswith(REFUSAL) and run.call != "engine.step()":
                return Outcome("refused", f"refused at {_CALLS[mode]} (RuntimeError)")
            return Outcome("crash", str(run).split(" (in ")[0])
        if not self.engine.ok:
            raise CannotTellError(f"{self.label}: engine.backward itself failed: {self.engine}")
        diff = compare(run.result.params, self.engine.result.params, self.job.dtype)
        if identical(run, self.engine):
            return Outcome("same", "identical", 0.0)
        if diff.close:
            return Outcome("same", f"Δ {diff.max_abs_diff:.1e} (within tolerance)", diff.max_abs_diff)
        return Outcome("differs", f"Δ {diff.max_abs_diff:.1e} (silently wrong)", diff.max_abs_diff)


def identical(a: Attempt, b: Attempt) -> bool:
    """Both trained to bit-identical parameters and gradient norms."""
    if not (a.ok and b.ok) or a.result.params.keys() != b.result.params.keys():
        return False
    return (all(np.array_equal(a.result.params[k], b.result.params[k]) for k in a.result.params)
            and a.result.grad_norms == b.result.grad_norms)


def backward_modes(label: str, job: Job, modes: Sequence[str] = DIRECT_MODES) -> BackwardModes:
    """Train ``job`` in this process with ``engine.backward`` and with each direct ``mode``."""
    return BackwardModes(label, job, attempt(job.with_(backward="engine")),
                         {mode: attempt(job.with_(backward=mode)) for mode in modes})


def backward_modes_all(rows: Sequence[tuple[str, Job]], modes: Sequence[str] = DIRECT_MODES) -> list[BackwardModes]:
    """Rank entry point for :func:`fixes.harness.launch`: :func:`backward_modes` for every row."""
    return [backward_modes(label, job, modes) for label, job in rows]


# ``engine.scale(loss).backward()``: DeepSpeed 0.18.3's API for a direct backward where a loss scale is
# needed (PR #7665; the engine-tensor-backward fix backports it): ``Job(backward="scaled")``.

def attempt_scaled(job: Job) -> Attempt:
    """``job`` trained with every backward as ``engine.scale(loss).backward()``; an exception is recorded
    instead of raised (:func:`attempt`)."""
    return attempt(job.with_(backward="scaled"))


def scaled_all(jobs: Sequence[Job]) -> list[tuple[Attempt, Attempt]]:
    """Rank entry point for :func:`fixes.harness.launch`: (``engine.backward``, ``engine.scale(loss).backward()``)
    for every job."""
    return [(attempt(job.with_(backward="engine")), attempt_scaled(job)) for job in jobs]
