"""The backlog rows whose fix ships no upstream test, decided by the differential sweep's grid.

    python -m ci.triage.grid --ds-clone PATH              # every "no upstream test" row (and those decided before)
    python -m ci.triage.grid --ds-clone PATH --pr 7786    # one row again
    python -m ci.triage.grid --ds-clone PATH --dry-run    # print the decisions, write nothing

For a row, the fix commit's diff names the DeepSpeed functions it changed (:func:`changed_code`: each changed line of
the file before the fix, mapped to the innermost function around it; a line outside every function counts for the
whole file). The grid's cells that *run* one of those functions on the last release without the fix are found by
running every cell of the differential design there once more with a call trace (:mod:`ci.differential.trace`;
kept under ``.cache/grid-trace/``, one file per release). Their verdicts on that release and on the first release
with the fix are read from the differential record (``fixes/data/differential.json``), where every cell ran on every
release. Outcomes:

* ``reproduced by the differential sweep`` — a cell that runs the changed code differs or crashes before the fix and
  agrees with plain PyTorch after it, the record's attribution does not explain that difference by another entry's
  bug (an entry that cites this PR counts for it), and the cell runs no code that another fix released in the same
  release changed (then which fix made it agree is not known): a candidate entry, ranked by ``python -m ci.triage
  --next``;
* ``not detected by the grid`` — no such cell: either no cell runs the changed code (the grid does not reach it), or
  those that do give the same verdict on both releases (each is named in the record);
* the row keeps what upstream's test said where the last release without the fix runs in no environment here.

A release older than the record's oldest runs in its ``[[older]]`` environment of ``ci/releases.toml`` (torch 2.3
for 0.14.1 – 0.14.3): there both releases of the pair run every cell, verdict and trace at once (:func:`measured_in`,
kept under ``.cache/grid-trace/<environment>/``), and the verdicts go into the row's outcome. No attribution runs
there; a difference that a known entry's trigger and measured range could explain is not claimed for the row.

The rows it decides are those whose upstream test cannot speak: the fix ships none (``no upstream test``), or the
test uses what the fix adds and cannot run without it (``could not run``, :func:`ci.triage.grid_decides`). The
outcome keeps upstream's state and reason under ``grid``, and the runs of upstream's test.

May import: ``ci.differential`` (its record, design and child runs), what ``ci.triage`` may, and ``ci.triage``.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from fixes.versions import parse

from .. import ROOT
from . import (COULD_NOT_RUN, GRID_NOT_DETECTED, GRID_REPRODUCED, NO_TEST, USES_THE_FIX, Clone, Outcome, Row, backlog,
               census_rows, grid_decides, load, neighbours, save)

TRACES = ROOT / ".cache" / "grid-trace"
WHOLE_FILE = "*"  # a changed line outside every function: any function of the file counts
FLIPS = ("differs", "crashes")


# ---- what the fix changed ----------------------------------------------------------------------------------------

def functions_at(source: str, lines: Iterable[int]) -> set[str]:
    """The qualified names (as ``co_qualname`` spells them) of the innermost functions around ``lines`` of
    ``source``; :data:`WHOLE_FILE` for a line outside every function (or where the source does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return {WHOLE_FILE}
    spans: list[tuple[int, int, str]] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{name}.")
                    continue
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                spans.append((first, child.end_lineno or child.lineno, name))
                walk(child, f"{name}.<locals>.")
            else:
                walk(child, prefix)

    walk(tree, "")
    found = set()
    for line in lines:
        around = [span for span in spans if span[0] <= line <= span[1]]
        found.add(min(around, key=lambda s: s[1] - s[0])[2] if around else WHOLE_FILE)
    return found


def changed_lines(diff: str) -> dict[str, set[int]]:
    """Per ``.py`` file a ``--unified=0`` diff changes (and that existed before it), the lines of the old version it
    changed or removed, and for a pure addition the line it follows and the one after."""
    changed: dict[str, set[int]] = {}
    path = None
    for line in diff.splitlines():
        if line.startswith("--- "):
            path = line[6:] if line.startswith("--- a/") and line.endswith(".py") else None
        elif path and line.startswith("@@"):
            match = re.match(r"@@ -(\d+)(?:,(\d+))? \+", line)
            if match:
                start, count = int(match[1]), int(match[2] if match[2] is not None else 1)
                changed.setdefault(path, set()).update(range(start, start + count) if count else (start, start + 1))
    return changed


def changed_code(clone: Clone, commit: str) -> dict[str, list[str]]:
    """{``deepspeed/...py``: sorted function names the fix changed (or :data:`WHOLE_FILE`)} for the files the commit
    changed that existed before it (a file it adds, no release without the fix can run)."""
    diff = clone.source_diff(commit)
    return {path: sorted(functions_at(clone.show(f"{commit}^", path, missing_ok=True), lines))
            for path, lines in sorted(changed_lines(diff).items())}


def touches(touched: Iterable[str], changed: Mapping[str, list[str]]) -> list[str]:
    """The changed functions (``path:name``) among a cell's ``touched`` ones; for :data:`WHOLE_FILE`, any function of
    that file the cell ran."""
    ran = set(touched)
    hits = set()
    for path, names in changed.items():
        for name in names:
            if name == WHOLE_FILE:
                hits.update(t for t in ran if t.startswith(f"{path}:"))
            elif f"{path}:{name}" in ran:
                hits.add(f"{path}:{name}")
    return sorted(hits)


# ---- what each cell runs -----------------------------------------------------------------------------------------

def _measure(release: str, todo: dict[str, dict[str, Any]], kept: dict[str, Any], path: Path, timeout: float,
             keep: Callable[[dict[str, Any]], Any], environment: str | None = None) -> dict[str, Any]:
    """Run ``todo``'s cells on ``release`` (in ``environment``, or the project's) in one child with the call trace,
    put ``keep(answer)`` of each answer in ``kept["cells"]`` (where it is not None) and write ``kept`` to ``path``; the cells a child that
    ended early reached are kept too."""
    from ..differential import run_child
    from ..differential import space as space_module

    if todo:
        with tempfile.TemporaryDirectory(prefix="grid-trace-") as folder:
            answers, failure = run_child(release, todo, dict(space_module.load().run), timeout * len(todo) + 60,
                                         timeout, trace=folder, environment=environment)
        for cell_id, answer in answers.items():
            value = keep(answer)
            if value is not None:
                kept["cells"][cell_id] = value
        if failure:
            where = f" in {environment}" if environment else ""
            print(f"ci.triage.grid: the trace on {release}{where} ended early ({failure}); the cells it reached are "
                  "kept", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(kept, sort_keys=True))
    return kept["cells"]


def _design() -> tuple[Any, dict[str, Any]]:
    """The differential space and {cell id: cell} of its design."""
    from ..differential import design as design_module
    from ..differential import space as space_module

    space = space_module.load()
    design = design_module.build(space)
    return space, dict(zip(design.ids, design.cells))


def traced(release: str, cache: Path = TRACES, timeout: float = 120.0) -> dict[str, list[str]]:
    """{cell id: the DeepSpeed functions it runs on ``release``} for every cell of the design the record ran there,
    read from ``cache`` or measured once (one child, every cell, with the call trace) and kept there."""
    from ..differential import record as record_module

    _, cells = _design()
    path = cache / f"{release}.json"
    kept = json.loads(path.read_text()) if path.exists() else {"release": release, "cells": {}}
    record = record_module.read()
    todo = {cell_id: {"cell": cell} for cell_id, cell in cells.items() if cell_id not in kept["cells"]
            and (record.row(cell_id, release) or {}).get("verdict") not in (None, "could not run")}
    return _measure(release, todo, kept, path, timeout, lambda answer: answer.get("touched"))


def older_spans() -> dict[str, str]:
    """{release: environment} for the releases an ``[[older]]`` environment of ``ci/releases.toml`` runs (its span,
    ``X.Y.A – X.Y.B``, within one minor version): releases older than the differential record's oldest."""
    from .. import releases as release_env

    found = {}
    for item in release_env.older():
        bounds = [parse(part.strip()) for part in item.span.split("–")] if "–" in item.span else []
        if item.environment and len(bounds) == 2 and bounds[0].release[:2] == bounds[1].release[:2]:
            major, minor = bounds[0].release[:2]
            for patch in range(bounds[0].release[2], bounds[1].release[2] + 1):
                found[f"{major}.{minor}.{patch}"] = item.environment
    return found


def older_releases() -> list[str]:
    """The releases an ``[[older]]`` environment runs, oldest first (:func:`older_spans`)."""
    return list(older_spans())


def older_environment(release: str) -> str | None:
    """The ``[[older]]`` environment that runs ``release`` (:func:`older_spans`), or None where none runs it."""
    return older_spans().get(str(parse(release)))


def measured_in(release: str, environment: str, cache: Path = TRACES, timeout: float = 120.0) -> dict[str, dict[str, Any]]:
    """{cell id: {"verdict", "touched", ...}} for every cell of the design on ``release`` in ``environment``: the
    releases the differential record does not hold (older than its oldest) run here, verdict and trace at once,
    kept under ``cache/<environment>/``."""
    from ..differential import unjudged

    space, cells = _design()
    path = cache / environment / f"{release}.json"
    kept = json.loads(path.read_text()) if path.exists() else {"release": release, "environment": environment,
                                                                 "cells": {}}
    todo = {cell_id: {"cell": cell} for cell_id, cell in cells.items()
            if cell_id not in kept["cells"] and unjudged(space, cell) is None}
    return _measure(release, todo, kept, path, timeout, lambda answer: answer, environment)


@dataclass
class Measured:
    """The record's view (:meth:`row`, :meth:`attributed`) of cells measured here in an older environment: the
    verdicts of :func:`measured_in`; a difference is attributed to nothing, but the entries whose trigger and
    measured range hold for the cell there are named (status ``candidates``)."""

    runs: dict[str, dict[str, dict[str, Any]]]  # release: cell: answer
    cells: dict[str, dict[str, Any]]
    entries: list[Any]
    flaky: set[str] = field(default_factory=set)  # cells whose verdict on either release did not show again

    def row(self, cell: str, release: str) -> dict[str, Any] | None:
        return self.runs.get(release, {}).get(cell)

    def attributed(self, cell: str, release: str) -> dict[str, Any] | None:
        from ..differential import attribute as attribute_module

        if cell in self.flaky:
            return {"status": "flaky"}
        found = attribute_module.candidates(self.cells[cell], release, self.entries)
        return {"status": "candidates", "entries": found} if found else None


AGAIN = 2  # runs after the first: a flip in an older environment must show in all three (a race shows in some)


def again(view: Measured, cells: list[str], releases: tuple[str, str], environment: str,
          timeout: float = 120.0, times: int = AGAIN) -> set[str]:
    """The ``cells`` whose verdict on either of ``releases`` is not the same in each of ``times`` more runs in
    ``environment``: the older releases have no attribution run, so a flip must repeat before it counts (the CPU
    ranks' ZeRO-3 gather race makes single differences that do not)."""
    from ..differential import run_child
    from ..differential import space as space_module

    run = dict(space_module.load().run)
    changed = set()
    for _ in range(times):
        for release in releases:
            answers, _ = run_child(release, {c: {"cell": view.cells[c]} for c in cells}, run,
                                   timeout * len(cells) + 60, timeout, environment=environment)
            changed |= {c for c in cells
                        if (answers.get(c) or {}).get("verdict") != view.runs[release][c].get("verdict")}
    return changed


# ---- the decision ------------------------------------------------------------------------------------------------

@dataclass
class Decision:
    """What the grid says of one row."""

    state: str
    reason: str
    before: str = ""
    after: str = ""
    changed: dict[str, list[str]] = field(default_factory=dict)
    cells: list[str] = field(default_factory=list)  # the cells that run the changed code on ``before``
    verdicts: dict[str, str] = field(default_factory=dict)  # cell: "<before verdict> -> <after verdict>"
    carrying: list[str] = field(default_factory=list)  # the cells that reproduce it
    explained: dict[str, str] = field(default_factory=dict)  # a flip another entry's bug explains: cell: why


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def decide(row: Row, before: str, after: str, changed: Mapping[str, list[str]], touched: Mapping[str, list[str]],
           record: Any, citing: Mapping[int, list[str]],
           rivals: Mapping[str, Mapping[str, list[str]]] | None = None) -> Decision:
    """The grid's outcome for ``row`` between ``before`` and ``after`` (see the module's docstring). ``touched``: the
    traced functions per cell on ``before``; ``record``: the differential record; ``citing``: PR -> entries citing it;
    ``rivals``: the other census rows first released in ``after``, each with what it changed. A cell that also runs
    a rival's changed code cannot tell which fix made it agree: its flip counts for neither."""
    base = dict(before=before, after=after, changed=dict(changed))
    running = {cell: touches(functions, changed) for cell, functions in sorted(touched.items())}
    running = {cell: hits for cell, hits in running.items() if hits}
    where = ", ".join(sorted(changed)[:3]) + (" and more" if len(changed) > 3 else "")
    if not changed:
        return Decision(GRID_NOT_DETECTED, f"the fix changes no DeepSpeed Python file that {before} has: no cell can "
                        "run what it changed", **base)
    if not running:
        return Decision(GRID_NOT_DETECTED, f"none of the {len(touched)} cells traced on {before} runs the code the "
                        f"fix changed ({where}): the grid does not reach it", **base)
    verdicts, carrying, explained = {}, [], {}
    for cell in running:
        was = (record.row(cell, before) or {}).get("verdict", "not recorded")
        now = (record.row(cell, after) or {}).get("verdict", "not recorded")
        verdicts[cell] = f"{was} -> {now}"
        if was not in FLIPS or now != "agrees":
            continue
        found = record.attributed(cell, before) or {}
        entries = list(found.get("entries") or ())
        also = sorted(key for key, theirs in (rivals or {}).items() if touches(touched[cell], theirs))
        if found.get("status") in ("explained", "candidates") and entries and \
                not any(e in citing.get(row.pr or 0, ()) for e in entries):
            explained[cell] = (f"explained by {', '.join(entries)}" if found["status"] == "explained" else
                               f"may be the bug of {', '.join(entries)} (its trigger and measured range hold there; "
                               "not attributed in this environment)")
        elif found.get("status") == "flaky":
            explained[cell] = "flaky: the difference did not repeat"
        elif also:
            explained[cell] = (f"it also runs what {', '.join('#' + key for key in also[:3])} changed, released in "
                               f"{after} too: which fix made it agree is not known")
        else:
            carrying.append(cell)
    base.update(cells=sorted(running), verdicts=verdicts, carrying=carrying, explained=explained)
    functions = sorted({hit for hits in running.values() for hit in hits})
    if carrying:
        shown = "; ".join(f"{cell}: {verdicts[cell]}" for cell in carrying[:3])
        return Decision(GRID_REPRODUCED, f"{_plural(len(carrying), 'cell')} running the changed code "
                        f"({', '.join(functions[:3])}) {'differs or crashes' if len(carrying) == 1 else 'differ or crash'}"
                        f" on {before} and {'agrees' if len(carrying) == 1 else 'agree'} on {after}: {shown}", **base)
    other = f"; {_plural(len(explained), 'difference')} that stop there {'is' if len(explained) == 1 else 'are'} " \
            f"not this fix's to claim ({'; '.join(f'{c}: {w}' for c, w in list(explained.items())[:2])})" if explained else ""
    return Decision(GRID_NOT_DETECTED, f"{_plural(len(running), 'cell')} run the changed code on {before} "
                    f"({', '.join(functions[:3])}{' and more' if len(functions) > 3 else ''}); none differs there and "
                    f"agrees on {after}{other}", **base)


def row_releases(row: Row, releases: list[str], known: Outcome | None = None) -> tuple[str | None, str | None]:
    """(the last release without the fix, the first with it) in the grid's ``releases``: from the census's first
    release, else (a fix the census snapshot had in no release yet) the one the triage found holding its code
    (``known.after``); None where there is none or the release before it is not in the grid."""
    first = row.first_release or (known.after if known is not None and known.after in releases else None)
    if not first or parse(first) > parse(releases[-1]):
        return None, None
    before, after = neighbours(first, releases)
    return before, after


def command(row: Row) -> str:
    return f"python -m ci.triage.grid --ds-clone PATH --pr {row.key}"


def outcome_for(row: Row, known: Outcome, decision: Decision | None, why_not: str = "") -> Outcome:
    """The row's outcome with the grid's decision (``decision`` None: it stays ``no upstream test``, ``why_not``)."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    kept = known.grid or {}
    upstream = kept.get("upstream", known.reason)
    upstream_state = kept.get("upstream_state", known.state)
    if upstream_state in (GRID_NOT_DETECTED, GRID_REPRODUCED):  # a row decided before its upstream state was kept
        upstream_state = COULD_NOT_RUN if upstream.startswith(USES_THE_FIX) else NO_TEST
    evidence = {"upstream": upstream, "upstream_state": upstream_state}
    if decision is None:  # what upstream's test said stands; the grid says why it could not decide
        return Outcome(row.key, row.pr, row.sha, row.component, row.symptom, upstream_state,
                       f"{upstream}; the grid: {why_not}", known.before, known.after, known.tests, known.selection,
                       known.runs, known.command, known.date,
                       grid={**evidence, "outside": why_not, "command": command(row), "date": date})
    return Outcome(row.key, row.pr, row.sha, row.component, row.symptom, decision.state, decision.reason,
                   before=decision.before, after=decision.after, tests=known.tests, selection=known.selection,
                   runs=known.runs, command=command(row), date=date, grid={**evidence, **asdict(decision)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.triage.grid", description=__doc__.splitlines()[0])
    parser.add_argument("--ds-clone", type=Path, required=True, help="a DeepSpeed git repository (a bare mirror will do)")
    parser.add_argument("--pr", action="append", help="census row by PR number or commit (repeatable)")
    parser.add_argument("--dry-run", action="store_true", help="print the decisions; write nothing")
    args = parser.parse_args(argv)
    import fixes

    from ..differential import record as record_module

    record = record_module.read()
    releases = sorted(record.releases, key=parse)
    clone = Clone(args.ds_clone)
    data = load()
    known = {key: Outcome.from_json(value) for key, value in data["rows"].items()}
    rows = [row for row in (census_rows() if args.pr else backlog()) if row.key in known
            and (grid_decides(known[row.key]) or known[row.key].grid)]
    if args.pr:
        rows = [row for row in rows if row.key in set(args.pr)]
        missing = set(args.pr) - {row.key for row in rows}
        if missing:
            print(f"ci.triage.grid: no 'no upstream test' row {', '.join(sorted(missing))} in the record "
                  "(python -m ci.triage --summary counts them)", file=sys.stderr)
            return 2
    citing: dict[int, list[str]] = {}
    for fix in fixes.all_fixes():
        for pr in fix.info.upstream_prs:
            citing.setdefault(pr, []).append(fix.id)
    for row in rows:  # a fix no release of the census snapshot had: the first installed release holding its code
        if not row.first_release and not known[row.key].after:
            from . import _machine

            found = _machine(args.ds_clone, 600.0).first_release_with(row, clone.commit(row))
            if found:
                known[row.key].after = found
    extended = sorted(set(releases) | set(older_releases()), key=parse)
    plans = {row.key: row_releases(row, extended, known[row.key]) for row in rows}
    changes: dict[str, dict[str, list[str]]] = {}

    def changed_by(census_row: Row) -> dict[str, list[str]]:
        if census_row.key not in changes:
            try:
                changes[census_row.key] = changed_code(clone, clone.commit(census_row))
            except Exception:  # noqa: BLE001 - a row whose commit the clone lacks changes nothing the grid can see
                changes[census_row.key] = {}
        return changes[census_row.key]

    every = census_rows()
    from ..differential import attribute as attribute_module
    from ..differential import design as design_module
    from ..differential import space as space_module

    design = design_module.build(space_module.load())
    entries = attribute_module.book_entries()
    needed = sorted({before for before, _ in plans.values() if before}, key=parse)
    print(f"{len(rows)} rows; tracing the grid on {len(needed)} releases", flush=True)
    states: dict[str, int] = {}
    for row in sorted(rows, key=lambda r: parse(plans[r.key][0] or "0")):
        before, after = plans[row.key]
        if before is None:
            why = (f"the last release without the fix is older than {extended[0]}, the oldest release an environment "
                   "here runs (ci/releases.toml [[older]] says why)" if row.first_release or known[row.key].after
                   else "the fix is in no installed release yet")
            outcome = outcome_for(row, known[row.key], None, why)
        else:
            rivals = {other.key: changed_by(other) for other in every
                      if other.key != row.key and other.first_release and parse(other.first_release) == parse(after)}
            environment = older_environment(before) if before not in releases else None
            if environment:  # both releases in the environment that runs the older one: one torch for the pair
                runs = {release: measured_in(release, environment) for release in (before, after)}
                view = Measured(runs, {c: cell for c, cell in zip(design.ids, design.cells)}, entries)
                touched = {cell: answer.get("touched", []) for cell, answer in runs[before].items()}
                decision = decide(row, before, after, changed_by(row), touched, view, citing, rivals)
                if decision.carrying:  # one run each: the flip must repeat before it counts
                    view.flaky = again(view, decision.carrying, (before, after), environment)
                    decision = decide(row, before, after, changed_by(row), touched, view, citing, rivals)
                decision.reason += f" (both releases measured in environment {environment})"
            else:
                decision = decide(row, before, after, changed_by(row), traced(before), record, citing, rivals)
            outcome = outcome_for(row, known[row.key], decision)
        states[outcome.state] = states.get(outcome.state, 0) + 1
        print(f"#{row.key} {row.component} ({before} -> {after}): {outcome.state}: {outcome.reason[:160]}", flush=True)
        if not args.dry_run:
            data["rows"][row.key] = asdict(outcome)
            save(data, rows=[row.key])
    print(", ".join(f"{n} {s}" for s, n in sorted(states.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
