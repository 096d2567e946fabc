"""The run record: what one notebook run established, typed from the notebook to the runner to the site.

A notebook writes it (``harness.Report``), the runner wraps it in a :class:`RunResult` with how the
run went, and the site and the tests read both. The verdict is computed here, once
(:attr:`RunResult.verdict`). Stdlib only: reading records needs neither torch nor DeepSpeed.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal

from .files import write_atomic

HISTORY = Path(__file__).resolve().parent / "data" / "runs.json"

Verdict = Literal["reproduced → fixed", "reproduced, fix not verified", "not affected", "not reproduced",
                  "notebook failed"]


@dataclass(frozen=True)
class Reproduction:
    """How the bug showed: ``kind`` "error" (``detail`` is the message) or "difference"."""

    kind: Literal["error", "difference"]
    detail: str
    max_abs_diff: float | None = None


@dataclass(frozen=True)
class Check:
    """One comparison against the plain-PyTorch reference after the fix."""

    name: str
    dtype: str
    max_abs_diff: float
    close: bool


@dataclass
class RunRecord:
    """What a notebook recorded: the environment, whether the bug showed, the fix, the checks."""

    entry: str
    environment: dict[str, Any] = field(default_factory=dict)
    affected: bool | None = None
    reproduced: Reproduction | None = None
    fix_action: str | None = None
    verified: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rank_devices: list[str] = field(default_factory=list)  # where the ranks it launched ran; [] if it launched none

    @property
    def verdict(self) -> Verdict:
        """What the run showed: the bug and its fix, no bug (an unaffected release), or — on an
        affected release — nothing, which is a failure of the entry."""
        if self.reproduced is not None:
            fixed = self.verified and all(check.close for check in self.verified)
            return "reproduced → fixed" if fixed else "reproduced, fix not verified"
        return "not affected" if self.affected is False else "not reproduced"

    @property
    def device(self) -> str:
        """``cpu`` or ``cuda``: where the notebook's DeepSpeed ran (the harness's ``accelerator``; its
        ``device`` names the processor or the GPU, e.g. ``NVIDIA H100 80GB HBM3``)."""
        return str(self.environment.get("accelerator") or "cpu")

    @property
    def gpu(self) -> str:
        """The GPU's name on a CUDA run, else ``""``."""
        return str(self.environment.get("device", "")) if self.device == "cuda" else ""

    @property
    def max_abs_diff_by_dtype(self) -> dict[str, float]:
        """The largest difference verified after the fix, per dtype."""
        largest: dict[str, float] = {}
        for check in self.verified:
            largest[check.dtype] = max(largest.get(check.dtype, 0.0), check.max_abs_diff)
        return largest

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunRecord":
        data = dict(data)
        data.pop("results_file", None)  # written by the notebook side, not part of the record
        reproduced = data.pop("reproduced", None)
        verified = data.pop("verified", [])
        return cls(**data, reproduced=Reproduction(**reproduced) if reproduced else None,
                   verified=[Check(**check) for check in verified])


@dataclass
class RunResult:
    """One notebook run on one release, as the runner saw it, with the notebook's record."""

    entry: str
    release: str
    kernel: str
    notebook: str
    executed: str
    status: Literal["passed", "failed"]
    wall_s: float
    error: str | None = None
    failed_cell: int | None = None
    record: RunRecord | None = None  # None: the notebook wrote none (it failed before its first cell)
    environment: str = "cpu"  # the Fixbook environment (ci/environments.toml) whose kernel ran it

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def verdict(self) -> Verdict:
        if not self.passed or self.record is None:
            return "notebook failed"
        return self.record.verdict

    @property
    def summary(self) -> str:
        if not self.passed:
            return f"FAILED at cell {self.failed_cell}: {self.error}"
        record = self.record
        if record is None:
            return "passed, but the notebook wrote no record"
        verdict: str = self.verdict
        if record.reproduced is not None:
            shown = record.reproduced
            what = shown.detail[:60] if shown.kind == "error" else f"diff {shown.max_abs_diff:.3e}"
            verdict = f"{verdict} ({what})"
        after = ", ".join(f"{dtype} {diff:.3e}" for dtype, diff in record.max_abs_diff_by_dtype.items())
        return f"{verdict}; fix {record.fix_action}" + (f"; max diff after: {after}" if after else "")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunResult":
        data = dict(data)
        record = data.pop("record", None)
        return cls(**data, record=RunRecord.from_json(record) if record else None)


# ---- the committed run history: which notebook ran where, with what verdict --------------------------

@dataclass(frozen=True)
class RunSummary:
    """One notebook run, as kept in ``fixes/data/runs.json`` (``python -m ci.notebooks.runner --record``)."""

    entry: str
    release: str
    environment: str
    device: str  # "cpu" or "cuda"
    python: str
    torch: str
    verdict: Verdict
    at: str  # the date of the run
    gpu: str = ""  # the GPU's name on a CUDA run
    ranks: str = ""  # on a CUDA run whose launched ranks ran on CPU (fewer GPUs than ranks): "cpu"
    reason: str = ""  # on a failed run: the failing cell and the first line of its error (:func:`failure_reason`)


def summarize(result: RunResult, at: str) -> RunSummary:
    env = result.record.environment if result.record else {}
    device = result.record.device if result.record else "cpu"
    gpu = result.record.gpu if result.record else ""
    ranks = "cpu" if device == "cuda" and result.record and "cpu" in result.record.rank_devices else ""
    return RunSummary(result.entry, result.release, result.environment, device, str(env.get("python", "")),
                      str(env.get("torch", "")), result.verdict, at, gpu, ranks, failure_reason(result))


REASON_CHARS = 160


def failure_reason(result: RunResult) -> str:
    """What a reader of an entry card needs of a failed run: ``cell N: <first line of the error>``, at most
    :data:`REASON_CHARS` characters, directories dropped from any absolute path (a run's machine paths stay off
    the site); "" for a passing run."""
    if result.passed:
        return ""
    first = next((line.strip() for line in (result.error or "").splitlines() if line.strip()), "no error text")
    first = re.sub(r"(?:/[\w.+-]+)+/", "", first)
    if len(first) > REASON_CHARS:
        first = first[:REASON_CHARS - 1].rstrip() + "…"
    return f"cell {result.failed_cell}: {first}" if result.failed_cell is not None else first


def history(path: Path = HISTORY) -> list[RunSummary]:
    """Every recorded run, oldest first; [] before the first record."""
    if not path.exists():
        return []
    return [RunSummary(**row) for row in json.loads(path.read_text())["runs"]]


def record_runs(summaries: Iterable[RunSummary], path: Path = HISTORY) -> None:
    """Add runs to the history, replacing an earlier run of the same entry, release, environment
    and device (the history holds the latest of each)."""
    from .files import locked

    fresh = list(summaries)
    keys = {(r.entry, r.release, r.environment, r.device) for r in fresh}
    with locked(path):  # two runners recording side by side keep each other's runs
        kept = [r for r in history(path) if (r.entry, r.release, r.environment, r.device) not in keys]
        rows = sorted(kept + fresh, key=lambda r: (r.entry, r.release, r.environment, r.device))
        write_atomic(path, json.dumps({"runs": [asdict(r) for r in rows]}, indent=1) + "\n")


PASSING: tuple[str, ...] = ("reproduced → fixed", "not affected")


def gpu_status(entry: str, runs: list[RunSummary] | None = None) -> str:
    """Where the entry's notebook ran on a GPU, from the run history (never typed): the releases where it
    reproduced the bug and verified the fix on CUDA, apart from those where it passed because the release is
    not affected there (no bug shown, no fix verified), and those where it failed; then the GPUs, Pythons,
    torches and dates of those runs."""
    runs = history() if runs is None else runs
    cuda = [r for r in runs if r.entry == entry and r.device == "cuda"]
    if not cuda:
        return "not run on a GPU yet (no CUDA run recorded)"
    fixed = [r for r in cuda if r.verdict == "reproduced → fixed" and not r.ranks]
    fixed_in_cpu_ranks = [r for r in cuda if r.verdict == "reproduced → fixed" and r.ranks == "cpu"]
    clean = [r for r in cuda if r.verdict == "not affected"]
    failed = [r for r in cuda if r.verdict not in PASSING]
    parts = []
    if fixed:
        parts.append(f"reproduced and fixed on CUDA: DeepSpeed {_releases(fixed)}")
    if fixed_in_cpu_ranks:
        parts.append("reproduced and fixed by the notebook on a one-GPU machine, its ranks on CPU (fewer GPUs than "
                     f"ranks): DeepSpeed {_releases(fixed_in_cpu_ranks)}")
    if clean:
        parts.append(f"passed, not affected on CUDA: DeepSpeed {_releases(clean)}")
    if failed:
        parts.append("failed on CUDA: " + ", ".join(f"{r.release}: {r.verdict}" + (f" ({r.reason})" if r.reason else "")
                                                    for r in failed))
    return "; ".join(parts) + f" ({_where(cuda)})"


def _releases(runs: list[RunSummary]) -> str:
    return ", ".join(sorted({r.release for r in runs}, key=_release_key))


def _where(runs: list[RunSummary]) -> str:
    """The GPUs, Pythons, torches and dates of ``runs``, each named once."""
    parts: list[str] = []
    for values in ({r.gpu for r in runs if r.gpu}, {f"Python {r.python}" for r in runs if r.python},
                   {f"torch {r.torch}" for r in runs if r.torch}, {r.at for r in runs}):
        parts.extend(sorted(values))
    return ", ".join(parts)


def _release_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in release.split(".") if part.isdigit())
