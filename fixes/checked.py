"""The configurations checked against plain PyTorch (``fixes/data/differential.json``, written by the differential
sweep) as a job sees them: which recorded cells are closest to a job and what they measured on a release.

A cell is compared with a job on the features both state (:func:`cell_features`, :func:`job_features`): ZeRO stage,
precision, whether it accumulates gradients, ``grad_accum_dtype``, optimizer offload, whether it runs on more than one
rank, ``contiguous_gradients``, the scheduler, whether it clips. A feature the job leaves open (``"auto"``) is not
compared. The closest cells are those with the fewest features unlike the job's. Stdlib only.
"""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .trigger import UNSET, Job
from .versions import parse

DATA = Path(__file__).resolve().parent / "data" / "differential.json"
JUDGED = ("agrees", "differs", "crashes")  # the verdicts that say something about the release
SCRIPTS = "generated/scripts/"  # where the site publishes each minimised configuration's script (ci/site/checked.py)
FEATURES = ("zero_stage", "precision", "accumulates", "grad_accum_dtype", "offload", "several_ranks",
            "contiguous_gradients", "scheduler", "clips")


@dataclass(frozen=True)
class Checked:
    """One recorded cell near a job, and its row on the release asked about."""

    cell_id: str
    cell: dict[str, Any]
    unlike: tuple[str, ...]  # the features in which the cell is not the job
    row: dict[str, Any]
    attribution: dict[str, Any] | None = None
    minimal: dict[str, Any] | None = None  # the minimised group of an unexplained row, if it was minimised
    scripts_url: str = ""  # where the site serves the minimised groups' scripts (the doctor's: the site's SCRIPTS)

    @property
    def text(self) -> str:
        verdict = self.row["verdict"]
        if verdict == "agrees":
            return "agrees"
        status = (self.attribution or {}).get("status")
        if status == "explained":
            return f"{verdict}: explained by {', '.join(self.attribution['entries'])}"
        if status == "flaky":
            return f"{verdict} once, agreed when run again (flaky)"
        if self.minimal and self.minimal.get("first"):
            values = ", ".join(f"{k}={v}" for k, v in self.minimal.get("set", {}).items()) or "every default"
            script = script_name(self.minimal["minimal"]) if self.minimal.get("script", {}).get("checked") else ""
            return (f"{verdict}: not explained yet; smallest configuration that fails so: {values}, on "
                    f"{self.minimal['first']} - {self.minimal['last']} ({self.row.get('command', '')}"
                    + (f"; a script to file upstream: {self.scripts_url or SCRIPTS}{script}" if script else "") + ")")
        return f"{verdict}: not explained yet ({self.row.get('command', '')})"


@dataclass(frozen=True)
class Record:
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    attribution: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    checked: str = ""  # when the last run was
    minimised: dict[str, dict[str, Any]] = field(default_factory=dict)  # unexplained rows' smallest configurations
    torch: str = ""  # what the rows were measured with
    python: str = ""

    def minimal_for(self, cell_id: str, release: str) -> tuple[str, dict[str, Any]] | None:
        """(key, minimised group) whose unexplained rows hold ``cell_id`` on ``release``, if it was minimised."""
        return next(((key, found) for key, found in self.minimised.items()
                     if found.get("cell") == cell_id and release in found.get("rows", ())), None)

    @property
    def releases(self) -> list[str]:
        return sorted({r for by_release in self.rows.values() for r in by_release}, key=parse)

    def attributed(self, cell_id: str, release: str) -> dict[str, Any] | None:
        return self.attribution.get(cell_id, {}).get(release)

    def showed(self, entry_id: str) -> list[tuple[str, str]]:
        """The (cell id, release) rows whose difference or crash ``entry_id`` explains (its fix made them agree)."""
        return sorted(((cell_id, release) for cell_id, by_release in self.attribution.items()
                       for release, found in by_release.items()
                       if found.get("status") == "explained" and entry_id in found.get("entries", ())),
                      key=lambda row: (parse(row[1]), row[0]))


def script_name(minimal: Mapping[str, Any]) -> str:
    """The file name of a minimal cell's standalone script (:mod:`fixes.harness.standalone`): the same minimal cell,
    the same name."""
    digest = hashlib.sha1(json.dumps(dict(minimal), sort_keys=True).encode()).hexdigest()[:10]
    return f"differential-{digest}.py"


def describe(cell: Mapping[str, Any]) -> str:
    """The cell's dimensions, as ``name=value`` pairs."""
    return ", ".join(f"{name}={value}" for name, value in cell.items())


@functools.lru_cache(maxsize=4)
def _parsed(path: str, mtime_ns: int, size: int) -> dict[str, Any]:  # noqa: ARG001 - the file's state is the key
    return json.loads(Path(path).read_text())


def read(path: Path = DATA) -> Record:
    """The record (an empty one where the file is missing). The file is parsed once while it is unchanged (the site
    reads it for every entry's card); treat what it returns as read-only."""
    if not path.exists():
        return Record()
    state = path.stat()
    data = _parsed(str(path), state.st_mtime_ns, state.st_size)
    return Record({k: v["cell"] for k, v in data.get("cells", {}).items()}, data.get("rows", {}),
                  data.get("attribution", {}), str(data.get("last_run", {}).get("at", "")), data.get("minimised", {}),
                  str(data.get("torch", "")), str(data.get("python", "")))


def cell_features(cell: Mapping[str, Any]) -> dict[str, Any]:
    precision = str(cell.get("precision", "fp32"))
    return {"zero_stage": int(cell.get("zero_stage", 0)),
            "precision": "fp16" if precision.startswith("fp16") else precision,
            "accumulates": int(cell.get("gradient_accumulation_steps", 1)) > 1,
            "grad_accum_dtype": str(cell.get("grad_accum_dtype", UNSET)),
            "offload": cell.get("offload_optimizer", "none") != "none",
            "several_ranks": int(cell.get("world_size", 1)) > 1,
            "contiguous_gradients": bool(cell.get("contiguous_gradients", True)),
            "scheduler": UNSET if cell.get("scheduler", "none") == "none" else cell["scheduler"],
            "clips": float(cell.get("gradient_clipping", 0.0)) > 0}


def job_features(job: Job) -> dict[str, Any]:
    """The job's features; None where the job leaves one open."""
    clipping = job.gradient_clipping
    gas = job.gradient_accumulation_steps
    return {"zero_stage": job.zero_stage, "precision": job.precision,
            "accumulates": None if gas is None else gas > 1,
            "grad_accum_dtype": job.grad_accum_dtype, "offload": job.offload_optimizer,
            "several_ranks": None if job.world_size is None else job.world_size > 1,
            "contiguous_gradients": job.contiguous_gradients,
            "scheduler": job.scheduler,
            # unset is not compared: DeepSpeed's default moved (0 before 0.19.3, 1.0 since)
            "clips": None if clipping is None or clipping == UNSET else float(clipping) > 0}


def closest(job: Job, release: str, record: Record | None = None, count: int = 3,
            scripts_url: str = "") -> list[Checked]:
    """The ``count`` recorded cells closest to ``job`` that were judged on ``release`` (fewest unlike features, then
    cell id), each with its row and attribution there."""
    record = read() if record is None else record
    wanted = job_features(job)
    found = []
    for cell_id, cell in record.cells.items():
        row = record.rows.get(cell_id, {}).get(release)
        if row is None or row.get("verdict") not in JUDGED:
            continue
        have = cell_features(cell)
        unlike = tuple(name for name in FEATURES if wanted[name] is not None and wanted[name] != have[name])
        minimal = record.minimal_for(cell_id, release)
        found.append(Checked(cell_id, dict(cell), unlike, row, record.attribution.get(cell_id, {}).get(release),
                             minimal[1] if minimal else None, scripts_url))
    found.sort(key=lambda c: (len(c.unlike), c.cell_id))
    return found[:count]


def statement(job: Job, release: str, record: Record | None = None, count: int = 3,
              scripts_url: str = "") -> list[str]:
    """What the checked configurations closest to ``job`` measured on ``release``, in lines for a user;
    ``scripts_url``: where the site serves the scripts a user can file upstream."""
    record = read() if record is None else record
    near = closest(job, release, record, count, scripts_url)
    if not near:
        known = ", ".join(record.releases) or "none"
        return [f"no configuration was checked against PyTorch on DeepSpeed {release} (checked releases: {known})"]
    same = sum(not c.unlike for c in near)
    when = f" (checked {record.checked})" if record.checked else ""
    head = f"the {len(near)} checked configurations closest to this job ({same} alike in every feature compared)"
    if all(c.row["verdict"] == "agrees" for c in near):
        lines = [f"{head} agree with PyTorch on {release}{when}:"]
    else:
        lines = [f"{head}, compared with PyTorch on {release}{when}:"]
    for c in near:
        unlike = f"; unlike this job in {', '.join(c.unlike)}" if c.unlike else ""
        lines.append(f"   {c.cell_id}: {c.text}{unlike}")
    return lines
