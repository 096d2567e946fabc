"""One job through DeepSpeed and through plain PyTorch, compared: the building block of the
configuration tables in silent-wrong-result entries (:class:`Versus`), and the record of a user's own script run in
a launched rank next to its plain-PyTorch reference (:class:`ScriptOutcome`, :func:`launch_script`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..exceptions import RankFailedError
from .compare import Comparison, compare
from .training import Job, TrainResult, train_deepspeed, train_reference


@dataclass(frozen=True)
class Versus:
    label: str
    job: Job
    deepspeed: TrainResult
    reference: TrainResult
    params: Comparison
    grad_norms: Comparison

    @property
    def close(self) -> bool:
        return self.params.close and self.grad_norms.close

    def row(self) -> dict[str, Any]:
        fmt = lambda norms: ", ".join(f"{n:.4f}" for n in norms)  # noqa: E731
        return {
            "configuration": self.label,
            "max |Δparam|": f"{self.params.max_abs_diff:.3e}",
            "grad norm DeepSpeed": fmt(self.deepspeed.grad_norms),
            "grad norm reference": fmt(self.reference.grad_norms),
            "within dtype tolerance": "yes" if self.close else "NO",
        }


def versus_reference(label: str, job: Job, keep: tuple[int, ...] | None = None) -> Versus:
    """Train ``job`` here through DeepSpeed and in plain PyTorch (``keep``: only those micro-batches,
    see :func:`train_reference`), and compare parameters and per-step gradient norms."""
    ds = train_deepspeed(job)
    ref = train_reference(job, keep=keep)
    return Versus(label, job, ds, ref,
                  params=compare(ds.params, ref.params, job.dtype, f"{label}: parameters"),
                  grad_norms=compare(ds.grad_norms, ref.grad_norms, job.dtype, f"{label}: gradient norms"))


@dataclass
class ScriptOutcome:
    """One run of a user's script (an entry's ``user_script``, written out as the user would write it) in a
    launched rank, next to its plain-PyTorch reference. ``error`` keeps the rank's failure; a failed run has
    nothing to compare and never :attr:`matches`. Entries add the fields their bug needs."""

    label: str
    dtype: str
    error: RankFailedError | None = None
    params: dict[str, Any] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    reference_params: dict[str, Any] = field(default_factory=dict)
    reference_losses: list[float] = field(default_factory=list)

    @property
    def error_line(self) -> str:
        """The rank's error as one line (``""`` when it did not fail)."""
        return "" if self.error is None else f"{self.error.exc_type}: {self.error.message}".splitlines()[0]

    def set_reference(self, reference: TrainResult) -> None:
        self.reference_params, self.reference_losses = reference.params, list(reference.losses)

    def comparisons(self) -> list[Comparison]:
        """The trained weights and the losses against the reference's, under the dtype's tolerance."""
        return [compare(self.params, self.reference_params, self.dtype, f"{self.label}, {self.dtype}: weights"),
                compare(self.losses, self.reference_losses, self.dtype, f"{self.label}, {self.dtype}: losses")]

    @property
    def matches(self) -> bool:
        return self.error is None and all(c.close for c in self.comparisons())

    @property
    def max_abs_diff(self) -> float:
        return max(c.max_abs_diff for c in self.comparisons())


def launch_script(outcome: ScriptOutcome, script: Callable[..., dict[str, Any]], *args: Any,
                  timeout: float = 180.0) -> dict[str, Any] | None:
    """``script(*args)`` in one freshly launched rank (every fix applied here is applied there first): its result,
    with ``params`` and ``losses`` copied into ``outcome``; or None, with the rank's error kept in
    ``outcome.error``. Any other failure (a hang: :class:`~fixes.exceptions.RankTimeoutError`) is raised."""
    from .launch import launch

    try:
        [result] = launch(script, 1, *args, timeout=timeout)
    except RankFailedError as exc:
        outcome.error = exc
        return None
    outcome.params, outcome.losses = result["params"], list(result["losses"])
    return result
