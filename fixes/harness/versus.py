"""One job through DeepSpeed and through plain PyTorch, compared: the building block of the
configuration tables in silent-wrong-result entries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
