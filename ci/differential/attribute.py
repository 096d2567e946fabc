"""Attribution: each differing or crashing (cell, release) of the record explained by entries of the book, or not.

A row is *explained* by entries when, for each of them,

* its trigger (``fixes/entries/<id>/trigger.py``) holds for the cell's job (:func:`cell_job`: the cell's DeepSpeed
  config as DeepSpeed resolves it, its world size, and what the cell does that a config cannot show), and
* its measured range (``fixes/data/sweep.json``) has the release *affected*,

and the cell, run again on that release with ``fixes.apply()`` of those entries (in the child and so in every rank
it launches, :func:`fixes.harness.launch`), *agrees*. A row with no such entries, or whose re-run with their fixes
does not agree, is run once more as it was (every differing row is, first: a difference not seen twice is
*flaky* and credits no entry; several entries whose fixes made it agree together are each tried
alone, :func:`narrow`: the row is explained by those whose fix alone suffices, or by all of them together): a difference that does not show twice is *flaky* (both values kept);
otherwise the row is *unexplained* (and which candidates were tried and what their fixes did). Minimisation of the
unexplained rows is not done yet: they are recorded "not minimised yet".

    python -m ci.differential --attribute [--release R] [--cell ID]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from fixes.harness.differential import Settings, ds_config
from fixes.trigger import Job, job_from_config

from .design import USE_VALUES

STATUSES = ("explained", "unexplained", "flaky")
ATTRIBUTED = ("differs", "crashes")  # the verdicts attribution looks at
NOT_MINIMISED = "not minimised yet"


def cell_uses(cell: Mapping[str, Any]) -> set[str]:
    """What the cell does that its config cannot show, as :data:`fixes.trigger.USES` words (the inverse of
    :data:`ci.differential.design.USE_VALUES`)."""
    return {use for use, (name, value) in USE_VALUES.items() if cell.get(name) == value}


def cell_job(cell: Mapping[str, Any]) -> Job:
    """The job of ``cell`` as the entries' triggers read it, as the differential sweep runs it: on the CPU
    accelerator, with this process's torch (the cells' ranks run with the same), loading a universal checkpoint
    with ``load_universal`` where the cell converts to one."""
    import torch

    settings = Settings.from_cell(dict(cell))
    job = job_from_config(ds_config(settings), world_size=settings.world_size, uses=cell_uses(cell))
    # the universal checkpoint is loaded with "checkpoint": {"load_universal": true}, which the cell adds at the load
    return job.with_(accelerator="cpu", torch=torch.__version__.split("+")[0],
                     load_universal=settings.checkpoint == "universal")


@dataclass(frozen=True)
class Entry:
    """What attribution needs of an entry: its trigger's answer for a job, and its measured release range."""

    id: str
    triggered: Callable[[Job], bool | None]
    affected: Callable[[str], bool | None]  # release -> measured affected (None: not measured / not decisive)


def book_entries() -> list[Entry]:
    """Every entry of the book with a trigger, and its sweep rows."""
    import fixes
    from fixes import measured

    data = measured.load()
    found = []
    for fix in fixes.registry.all_fixes():
        if getattr(fix, "trigger", None) is None:
            continue
        sweep = data.entry(fix.id)
        found.append(Entry(fix.id, lambda job, t=fix.trigger: t.evaluate(job).triggered, sweep.expected_affected))
    return found


def candidates(cell: Mapping[str, Any], release: str, entries: Iterable[Entry]) -> list[str]:
    """The entries whose trigger holds for ``cell`` (True, not open) and whose measured range has ``release``."""
    job = cell_job(cell)
    return sorted(e.id for e in entries if e.triggered(job) is True and e.affected(release) is True)


def decide(row: Mapping[str, Any], tried: list[str], with_fixes: Mapping[str, Any] | None,
           again: Mapping[str, Any] | None) -> dict[str, Any]:
    """The attribution of one differing/crashing ``row``: ``tried`` the candidate entries, ``with_fixes`` the re-run
    with their fixes applied (None: not run, no candidate), ``again`` the re-run as it was (None: not run)."""
    if row.get("verdict") not in ATTRIBUTED:
        raise ValueError(f"only {' and '.join(ATTRIBUTED)} rows are attributed, not {row.get('verdict')!r}")
    if row["verdict"] == "differs" and again is not None and again.get("verdict") == "agrees":
        # a difference seen once only: no entry is credited with it, whatever its fixes' run gave
        flaky = {"status": "flaky", "entries": [], "again": _short(again)}
        return {**flaky, "tried": list(tried)} if tried else flaky
    if tried and with_fixes is not None and with_fixes.get("verdict") == "agrees":
        found = {"status": "explained", "entries": list(tried), "with_fixes": _short(with_fixes)}
        return {**found, "again": _short(again)} if again is not None else found
    found: dict[str, Any] = {"entries": []}
    if tried:
        found["tried"] = list(tried)
        found["with_fixes"] = _short(with_fixes) if with_fixes is not None else {"verdict": "could not run",
                                                                                 "error": "not re-run"}
    if again is not None:
        found["again"] = _short(again)
    return {**found, "status": "unexplained", "minimised": NOT_MINIMISED}


def narrow(found: Mapping[str, Any], alone: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """An explained row whose several entries' fixes made it agree together, narrowed to the entries whose fix alone
    makes it agree (``alone``: entry -> the re-run with only its fix); where none does alone, they explain it
    together (``"together": True``)."""
    if found.get("status") != "explained":
        return dict(found)
    sufficient = sorted(e for e, verdict in alone.items() if verdict.get("verdict") == "agrees")
    narrowed = {**found, "applied_together": list(found["entries"]),
                "alone": {e: _short(v) for e, v in sorted(alone.items())}}
    if sufficient:
        return {**narrowed, "entries": sufficient}
    return {**narrowed, "together": True}


def _short(verdict: Mapping[str, Any]) -> dict[str, Any]:
    keep = ("verdict", "max_diff", "first_step", "quantity", "error", "applied")
    return {k: verdict[k] for k in keep if verdict.get(k) not in (None, "", [])}


def counts(attribution: Mapping[str, Mapping[str, Mapping[str, Any]]], release: str | None = None
           ) -> tuple[dict[str, int], dict[str, int]]:
    """({status: rows}, {entry: rows it explains}) over the attribution (of one ``release``)."""
    statuses = {status: 0 for status in STATUSES}
    by_entry: dict[str, int] = {}
    for by_release in attribution.values():
        for row_release, found in by_release.items():
            if release is not None and row_release != release:
                continue
            statuses[found["status"]] += 1
            if found["status"] == "explained":
                for entry in found["entries"]:
                    by_entry[entry] = by_entry.get(entry, 0) + 1
    return statuses, dict(sorted(by_entry.items(), key=lambda kv: (-kv[1], kv[0])))
