"""The measured version matrix: for every entry and every DeepSpeed release swept, whether the bug
showed there. ``python -m ci.sweep`` writes it to ``fixes/data/sweep.json`` (committed, and shipped
with the package so ``fixbook doctor`` has it); every affected range the Fixbook states — entry
metadata, the CLI, the site — is derived here from that one file. Nobody types a range by hand.

An observation's status:

* ``affected`` / ``not affected`` — the entry's code probe and its behavioural check agree;
* ``inconsistent`` — they disagree (the reason says how); never counted as either;
* ``could not run`` — the release did not import or the check failed or timed out (reason kept).

Every ``affected`` observation also says what the entry's fix does there (its *coverage*): the sweep
applies it and runs the behavioural check again with it in place:

* ``fixed`` — it applied and the check no longer shows the bug;
* ``not fixed`` — it applied but the bug still shows;
* ``refused`` — ``apply()`` raised DriftError: the code is not what the fix was written for;
* ``could not run`` — applying or re-checking failed otherwise (reason kept).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

from .exceptions import SweepFileError
from .files import INFO_FILE, write_atomic
from .versions import parse

DATA = Path(__file__).resolve().parent / "data" / "sweep.json"
DEFAULT_ENVIRONMENT = "cpu"  # the project venv: Python 3.11 and the CPU torch of ci/releases.toml

Status = Literal["affected", "not affected", "inconsistent", "could not run"]
STATUSES: tuple[str, ...] = ("affected", "not affected", "inconsistent", "could not run")
FixStatus = Literal["fixed", "not fixed", "refused", "could not run"]
OLDEST_MEASURED = "the oldest release measured"  # how a range that starts there says so (EntrySweep.range_text)
FIX_STATUSES: tuple[str, ...] = ("fixed", "not fixed", "refused", "could not run")


@dataclass(frozen=True)
class Observation:
    """One entry on one release."""

    release: str
    status: Status
    probe: bool | None = None  # the code probe's answer, if it ran
    reproduced: bool | None = None  # the behavioural check's answer, if the entry has one and it ran
    reason: str = ""  # evidence, or why it could not run
    seconds: float | None = None
    fix: FixStatus | None = None  # affected only: what applying the fix did (None: not measured)
    fix_reason: str = ""  # what apply() said, or why it refused / could not run
    code: str = ""  # the entry's code it was measured with (:func:`entry_code`; "" before this was recorded)
    environment: str = DEFAULT_ENVIRONMENT  # the (Python, torch) environment it ran in (ci/environments.toml)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"unknown status {self.status!r} for {self.release}; use one of {STATUSES}")
        if self.fix is not None and self.fix not in FIX_STATUSES:
            raise ValueError(f"unknown fix status {self.fix!r} for {self.release}; use one of {FIX_STATUSES}")

    @property
    def affected(self) -> bool | None:
        return {"affected": True, "not affected": False}.get(self.status)


def classify(probe: bool | None, reproduced: bool | None) -> tuple[Status, str]:
    """The status of a run whose checks answered ``probe`` and ``reproduced`` (None: did not run)."""
    if probe is None and reproduced is None:
        return "could not run", "neither the probe nor the behavioural check ran"
    if probe is not None and reproduced is not None and probe != reproduced:
        return "inconsistent", (f"the code probe says {'affected' if probe else 'not affected'} but the "
                                f"behavioural check {'shows' if reproduced else 'does not show'} the bug")
    answer = reproduced if reproduced is not None else probe
    return ("affected" if answer else "not affected"), ""


@dataclass(frozen=True)
class EntrySweep:
    """Every observation of one entry, and the ranges derived from them."""

    entry: str
    observations: dict[str, Observation] = field(default_factory=dict)

    @property
    def releases(self) -> list[str]:
        return sorted(self.observations, key=parse)

    def get(self, release: str) -> Observation | None:
        return self.observations.get(release)

    def expected_affected(self, release: str) -> bool | None:
        """True/False where measured affected/not affected; None if not swept or not decisive."""
        observation = self.observations.get(release)
        return None if observation is None else observation.affected

    def with_status(self, status: Status) -> list[str]:
        return [r for r in self.releases if self.observations[r].status == status]

    @property
    def affected(self) -> list[str]:
        return self.with_status("affected")

    @property
    def unaffected(self) -> list[str]:
        return self.with_status("not affected")

    def with_fix(self, fix_status: FixStatus) -> list[str]:
        """Affected releases whose fix coverage is ``fix_status``."""
        return [r for r in self.affected if self.observations[r].fix == fix_status]

    @property
    def fixed(self) -> list[str]:
        return self.with_fix("fixed")

    @property
    def unfixable(self) -> list[str]:
        """Affected releases where the fix was measured and does not fix: refused, not fixed, or it failed."""
        return [r for r in self.affected if self.observations[r].fix not in (None, "fixed")]

    @property
    def coverage_text(self) -> str:
        """E.g. ``fixed on 14 of 14 affected releases`` (plus where not, and why in brief)."""
        affected = self.affected
        if not affected:
            return "no affected release"
        text = f"fixed on {len(self.fixed)} of {len(affected)} affected releases"
        unmeasured = [r for r in affected if self.observations[r].fix is None]
        if self.unfixable:
            text += f"; no fix for {compress(self.unfixable, self.releases)}"
        if unmeasured:
            text += f"; not measured on {compress(unmeasured, self.releases)}"
        return text

    @property
    def first_affected(self) -> str | None:
        return self.affected[0] if self.affected else None

    @property
    def last_affected(self) -> str | None:
        return self.affected[-1] if self.affected else None

    @property
    def first_fixed(self) -> str | None:
        """The first release after the last affected one that was measured not affected; None while
        the newest release swept is still affected (or nothing after it ran)."""
        last = self.last_affected
        if last is None:
            return None
        later = [r for r in self.releases if parse(r) > parse(last)]
        return next((r for r in later if self.observations[r].status == "not affected"), None)

    @property
    def ranges(self) -> list[tuple[str, str]]:
        """Runs of consecutive affected releases (``could not run`` and ``inconsistent`` releases
        break a run: nothing is claimed for them)."""
        runs: list[tuple[str, str]] = []
        start = previous = None
        for release in self.releases:
            if self.observations[release].status == "affected":
                start = start or release
                previous = release
            elif start:
                runs.append((start, previous))  # type: ignore[arg-type]
                start = previous = None
        if start:
            runs.append((start, previous))  # type: ignore[arg-type]
        return runs

    @property
    def starts_at_oldest(self) -> bool:
        """Whether the first affected release is the oldest release measured: the bug may well be older, and its
        range says where the measuring starts, not where the bug does."""
        return bool(self.ranges) and self.ranges[0][0] == self.releases[0]

    @property
    def start_unknown(self) -> bool:
        """Whether no release before the first affected one was measured *not affected*: the oldest release
        measured is affected, or every older one could not run (or was inconsistent). The range's start is then
        where the measuring found the bug first, not where the bug starts."""
        if not self.ranges:
            return False
        first = self.ranges[0][0]
        return not any(self.observations[r].status == "not affected" for r in self.releases if parse(r) < parse(first))

    @property
    def range_text(self) -> str:
        """E.g. ``0.17.6 – 0.18.2`` or ``0.18.3 – 0.19.8 (newest swept)``; ``none`` if never affected. A range whose
        start is unknown never reads as a start: ``since at least 0.14.4 (the oldest release measured) to 0.17.3``
        (one release alone: ``..., not after it``), or ``since at least 0.16.0 (older releases measured could not
        run) to 0.17.3`` (``no older release was measured not affected`` where some were inconsistent:
        :attr:`start_unknown`)."""
        if not self.ranges:
            return "none"
        newest = self.releases[-1]
        runs = [f"{a} – {b}" if a != b else a for a, b in self.ranges]
        if self.start_unknown:
            first, last = self.ranges[0]
            older = {self.observations[r].status for r in self.releases if parse(r) < parse(first)}
            why = (OLDEST_MEASURED if self.starts_at_oldest else "older releases measured could not run"
                   if older == {"could not run"} else "no older release was measured not affected")
            runs[0] = f"since at least {first} ({why})" + (f" to {last}" if last != first else ", not after it")
        return ", ".join(runs) + (" (newest swept)" if self.ranges[-1][1] == newest else "")

    @property
    def boundaries(self) -> list[str]:
        """The releases where the answer changes: first and last affected, first fixed."""
        found = {self.first_affected, self.last_affected, self.first_fixed} - {None}
        return sorted(found, key=parse)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SweepData:
    """The whole file: which releases, on what, and every entry's observations.

    ``results`` are the rows of the default environment (``cpu``), the ones every range is derived
    from; ``environments`` holds the rows measured in the other environments (``ci.sweep --env NAME``),
    one :class:`SweepData` each, so a torch-2.0 row never replaces a ``cpu`` row of the same release."""

    releases: list[str]
    results: dict[str, EntrySweep]
    torch: str = ""
    python: str = ""
    last_run: dict[str, Any] = field(default_factory=dict)  # the latest sweep, whole or partial
    full_run: dict[str, Any] = field(default_factory=dict)  # the latest one of every entry × every release
    environments: dict[str, "SweepData"] = field(default_factory=dict)  # name -> its rows (not "cpu")

    def entry(self, entry_id: str) -> EntrySweep:
        return self.results.get(entry_id, EntrySweep(entry_id))

    def environment(self, name: str) -> "SweepData":
        """The rows measured in environment ``name`` (this file's own for ``cpu``; empty if none)."""
        if name == DEFAULT_ENVIRONMENT:
            return self
        return self.environments.get(name, SweepData(releases=[], results={}))

    def to_json(self) -> dict[str, Any]:
        document = {
            "torch": self.torch,
            "python": self.python,
            "last_run": self.last_run,
            "full_run": self.full_run,
            "releases": sorted(self.releases, key=parse),
            "results": {entry: {release: _compact(sweep.observations[release]) for release in sweep.releases}
                        for entry, sweep in sorted(self.results.items())},
        }
        if self.environments:
            document["environments"] = {name: sub.to_json() for name, sub in sorted(self.environments.items())}
        return document


def compress(chosen: list[str], order: list[str]) -> str:
    """``chosen`` releases as runs over ``order``: ``0.16.0 – 0.17.3, 0.19.7``."""
    runs: list[list[str]] = []
    position = {release: i for i, release in enumerate(order)}
    for release in sorted(chosen, key=lambda r: position.get(r, -1)):
        if runs and position.get(release, -2) == position.get(runs[-1][-1], -3) + 1:
            runs[-1].append(release)
        else:
            runs.append([release])
    return ", ".join(run[0] if len(run) == 1 else f"{run[0]} – {run[-1]}" for run in runs)


def _compact(observation: Observation) -> dict[str, Any]:
    data = asdict(observation)
    data.pop("release")
    if data["fix"] is None:  # rows without coverage stay as they were
        data.pop("fix")
        data.pop("fix_reason")
    if not data["code"]:
        data.pop("code")
    data.pop("environment")  # implied by where the row is stored (SweepData.environments)
    return data


def entry_code(entry_id: str) -> str:
    """A short hash of what an entry's measurement depends on in this checkout: its package's source
    (``fixes/entries/<id>/*.py``: the fix and its reproduction; not ``trigger.py``, which the sweep does not run), its
    metadata (``info.toml``: ``measured_under`` chooses what the sweep runs under) and its recorded fingerprints. A
    row measured with another value is stale (``ci.sweep --resume`` measures it again; ``ci.sweep.restamp`` carries
    a row over a change of form alone)."""
    import hashlib

    from . import fingerprints

    package = Path(__file__).resolve().parent / "entries" / entry_id.replace("-", "_")
    digest = hashlib.sha256()
    for module in sorted([*package.glob("*.py"), package / INFO_FILE]):
        if module.name != "trigger.py" and module.is_file():
            digest.update(module.name.encode() + b"\0" + module.read_bytes())
    digest.update(json.dumps(fingerprints.recorded(entry_id), sort_keys=True).encode())
    return digest.hexdigest()[:12]


def from_json(data: dict[str, Any], environment: str = DEFAULT_ENVIRONMENT) -> SweepData:
    results = {entry: EntrySweep(entry, {release: Observation(release=release, **{"environment": environment, **fields})
                                         for release, fields in rows.items()})
               for entry, rows in data.get("results", {}).items()}
    others = {name: from_json(sub, name) for name, sub in data.get("environments", {}).items()}
    return SweepData(releases=list(data.get("releases", [])), results=results, torch=data.get("torch", ""),
                     python=data.get("python", ""), last_run=dict(data.get("last_run", {})),
                     full_run=dict(data.get("full_run", {})), environments=others)


def read(path: Path = DATA) -> SweepData:
    """The sweep file at ``path``; an empty sweep if there is none yet. A file that does not parse
    raises :class:`~fixes.exceptions.SweepFileError` naming it: it is never read as "not measured"."""
    if not path.exists():
        return SweepData(releases=[], results={})
    try:
        return from_json(json.loads(path.read_text()))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise SweepFileError(f"the sweep file {path} is damaged ({type(exc).__name__}: {exc}); restore it with "
                             f"`git checkout -- {path.name if path == DATA else path}` (fixes/data/sweep.json in "
                             "a checkout) or measure again with `python -m ci.sweep`") from exc


@cache
def load() -> SweepData:
    """The committed sweep (read once per process)."""
    return read(DATA)


def for_entry(entry_id: str) -> EntrySweep:
    return load().entry(entry_id)


def dumps(data: SweepData) -> str:
    """JSON with one line per observation, so a re-sweep's diff reads release by release."""
    return _dumps(data.to_json()) + "\n"


def _dumps(document: dict[str, Any], indent: str = "") -> str:
    document = dict(document)
    results = document.pop("results")
    others = document.pop("environments", {})
    head = json.dumps(document, indent=1)[:-2].replace("\n", "\n" + indent)  # without the closing brace
    entries = []
    for entry, rows in results.items():
        lines = ",\n".join(f"{indent}   {json.dumps(release)}: {json.dumps(row)}" for release, row in rows.items())
        entries.append(f"{indent}  {json.dumps(entry)}: {{\n{lines}\n{indent}  }}")
    text = head + f',\n{indent} "results": {{\n' + ",\n".join(entries) + f"\n{indent} }}"
    if others:
        subs = [f"{indent}  {json.dumps(name)}: " + _dumps(sub, indent + "  ").lstrip()
                for name, sub in others.items()]
        text += f',\n{indent} "environments": {{\n' + ",\n".join(subs) + f"\n{indent} }}"
    return text + f"\n{indent}}}"


def write(data: SweepData, path: Path = DATA) -> None:
    """Replace the file atomically: a reader (or an interrupt) never sees half of it."""
    write_atomic(path, dumps(data))
    load.cache_clear()


def _minor(version: str) -> str:
    """``2.13`` of ``2.13.0+cpu``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def environment_for_torch(torch_version: str | None) -> tuple[str | None, SweepData]:
    """The environment whose measurements match a user's torch (same minor version), and its rows:
    (name, rows); (None, the default rows) where none matches."""
    data = load()
    if torch_version:
        if data.torch and _minor(data.torch) == _minor(torch_version):
            return DEFAULT_ENVIRONMENT, data
        for name, rows in sorted(data.environments.items()):
            if rows.torch and _minor(rows.torch) == _minor(torch_version):
                return name, rows
    return None, data
