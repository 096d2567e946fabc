"""The differential sweep: the cells of a covering design over the configuration space users run (``space.toml``),
each trained a few optimizer steps through DeepSpeed and in plain PyTorch, on every release asked for.

    python -m ci.differential --design                         # the cells, their count, and the proof of coverage
    python -m ci.differential --release 0.19.8 --release 0.16.0  # every cell on those releases, into the record
    python -m ci.differential --cell ID --release 0.19.8       # one row again (the command each row records)
    python -m ci.differential --resume --release 0.19.8        # only the rows the record lacks or could not run
    python -m ci.differential --resume --redo differs ...      # and the rows that differed (after a reference change)
    python -m ci.differential --limit 20 --release 0.19.8      # the first 20 cells of the design only
    python -m ci.differential --shard 2/4 --release ...        # part 2 of 4 of the plan, for machines side by side
    python -m ci.differential --merge p1.json p2.json ...      # the parts' rows into --out
    python -m ci.differential --summary                        # what the record says
    python -m ci.differential --attribute [--release R]        # explain the differing/crashing rows by entries
    python -m ci.differential --minimise [--cell ID]           # the unexplained rows' smallest configurations
    python -m ci.differential --cross-check                    # does each entry's bug show in its trigger cell?
    python -m ci.differential --scripts [--resume]             # each minimal cell as a script, run where it fails/agrees
    python -m ci.differential --script KEY > repro.py          # one minimised group's script, to file upstream

Each release runs in one child process with that release selected (``ci.releases``), forked from a zygote as the
release sweep's are (``ci.processes.zygote``); the child runs each cell through :func:`fixes.harness.differential.run_cell`
(the DeepSpeed side on freshly launched ranks) and prints one marked JSON line per cell. A child that dies or
times out has its unfinished cells run again one at a time, each under its own timeout, so a hang is recorded
against its cell. A cell with a value the reference does not model (``space.toml``'s ``unmodelled``) is recorded
*could not run* without running. Each release's rows are merged into the record as soon as they are in (atomic,
under the release sweep's lock: one writer at a time, a second refuses).

``--attribute`` explains the record's differing and crashing rows by entries (:mod:`ci.differential.attribute`:
trigger, measured range, and a re-run with the entries' fixes applied that agrees; a difference seen only once is
*flaky*) and records it beside the rows. ``--minimise`` reduces each cell's unexplained rows to the smallest
configuration that still fails the same way and runs it on every release of the sweep (:mod:`ci.differential.minimise`).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

from fixes.versions import parse

from .. import releases as release_env
from .. import sweep
from ..notebooks import shards
from ..processes import zygote
from . import attribute as attribute_module
from . import design as design_module
from . import minimise as minimise_module
from . import record as record_module
from . import space as space_module

MARK = "FIXBOOK-DIFFERENTIAL "
DEFAULT_RELEASES = ("0.19.8", "0.16.0")
CELL_TIMEOUT = 120.0  # seconds per cell (the slowest measured: a few seconds on 2 CPUs)


@dataclass(frozen=True)
class Row:
    cell: str
    release: str


# ---- the child ---------------------------------------------------------------------------------------------------

def child_main(cells_file: str) -> int:
    """Inside one release's process: each cell of ``cells_file`` ({id: {"cell": ..., "run": ...}}) through
    :func:`fixes.harness.differential.run_cell`, one marked JSON line each."""
    from ..processes.kernel_server import start_rank_server

    work = json.loads(Path(cells_file).read_text())
    if work.get("trace"):
        from . import trace

        trace.start(work["trace"])  # before the rank server forks: every rank inherits the hook
    start_rank_server()  # before anything is set up: the ranks' launches fork from this state
    from fixes import harness
    from fixes.harness import differential

    harness.setup()
    for cell_id, item in work["cells"].items():
        answer: dict[str, Any] = {"cell": cell_id}
        applying = list(item.get("apply") or ())
        try:
            settings = differential.Settings.from_cell(item["cell"], work.get("run"))
            refused = _apply(applying, answer)
            if refused:
                answer.update(verdict="could not run", error=refused)
            else:
                answer.update(differential.run_cell(settings, timeout=float(work.get("timeout", CELL_TIMEOUT))).as_dict())
        except Exception as exc:  # noqa: BLE001 - the harness failed, not DeepSpeed: this cell could not run
            answer.update(verdict="could not run", error=f"harness: {type(exc).__name__}: {exc}".splitlines()[0][:300])
        finally:
            if applying:
                import fixes

                fixes.revert(*applying)
            if work.get("trace"):
                answer["touched"] = trace.collect()
        print(MARK + json.dumps(answer), flush=True)
    return 0


def _apply(ids: list[str], answer: dict[str, Any]) -> str:
    """Apply the fixes ``ids`` in this process (the ranks a cell launches apply them too); "" or why not all
    applied. What each apply() said goes into ``answer["applied"]``."""
    if not ids:
        return ""
    import fixes

    try:
        outcomes = fixes.apply(*ids)
    except Exception as exc:  # noqa: BLE001 - a refusal (DriftError) or a broken fix: no explanation from it
        return f"apply() raised {type(exc).__name__}: {exc}".splitlines()[0][:300]
    answer["applied"] = [f"{o.fix_id}: {o.action}" for o in outcomes]
    failed = [o for o in outcomes if o.action not in ("applied", "already applied")]
    return "; ".join(f"{o.fix_id}: apply() said {o.action}: {o.message}" for o in failed)[:300]


def _answers(stdout: str) -> dict[str, dict[str, Any]]:
    found = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            answer = json.loads(line[len(MARK):])
            found[answer.pop("cell")] = answer
    return found


def run_child(release: str, cells: dict[str, dict[str, Any]], run: dict[str, Any], timeout: float,
              cell_timeout: float, trace: str | None = None,
              environment: str | None = None) -> tuple[dict[str, dict[str, Any]], str]:
    """One child under ``release`` for ``cells``: (answers by cell id, why it ended early or ""). With ``trace`` (a
    folder), each answer also holds the DeepSpeed functions the cell ran (``touched``, :mod:`.trace`). With
    ``environment`` (a name of ``ci/environments.toml``), that environment's Python runs it (a release older than
    the sweep's oldest runs only in its ``[[older]]`` environment)."""
    python = sys.executable
    env = {**os.environ, **release_env.environment(release), "DS_ACCELERATOR": "cpu"}
    if environment:
        from ..releases import environments

        chosen = environments.require(environment)
        python, env = str(chosen.executable), {**os.environ, **environments.variables(chosen, release),
                                              "DS_ACCELERATOR": "cpu"}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="differential-", delete=False) as handle:
        json.dump({"cells": cells, "run": run, "timeout": cell_timeout, **({"trace": trace} if trace else {})}, handle)
    try:
        stdout, failure = sweep.run_tracked(
            [*zygote.command(python, env), "-m", "ci.differential", "--child", handle.name], env, timeout)
    finally:
        os.unlink(handle.name)
    return _answers(stdout), failure


def run_release(release: str, cells: dict[str, dict[str, Any]], run: dict[str, Any],
                cell_timeout: float) -> dict[Row, dict[str, Any]]:
    """Every cell on one release, in one child; the cells it did not finish again one by one."""
    answers, failure = run_child(release, cells, run, cell_timeout * len(cells) + 60, cell_timeout)
    for cell_id in [c for c in cells if c not in answers] if failure else []:
        alone, why = run_child(release, {cell_id: cells[cell_id]}, run, cell_timeout + 60, cell_timeout)
        answers[cell_id] = alone.get(cell_id) or {"verdict": "crashes" if "timed out" in why or "signal" in why
                                                  else "could not run", "error": why or failure or "no answer"}
    return {Row(cell_id, release): {**answers.get(cell_id, {"verdict": "could not run", "error": failure or "no answer"}),
                                    "command": record_module.repeat_command(cell_id, release)}
            for cell_id in cells}


# ---- the plan ----------------------------------------------------------------------------------------------------

def plan_for(design: design_module.Design, chosen: list[str], old: record_module.Record | None,
             only: list[str] | None = None, limit: int | None = None,
             redo: tuple[str, ...] = ("could not run",)) -> dict[str, list[str]]:
    """{release: [cell id, ...]}: every cell of the design (``only`` those ids; the first ``limit``) on every chosen
    release; with ``old`` only the rows it lacks or whose verdict is in ``redo`` (by default those that could not
    run, as ``ci.sweep --resume``)."""
    ids = list(design.ids)
    if only:
        unknown = sorted(set(only) - set(ids))
        if unknown:
            raise ValueError(f"no cell {', '.join(unknown)} in the design (python -m ci.differential --design lists them)")
        ids = [i for i in ids if i in only]
    if limit is not None:
        ids = ids[:limit]
    plan = {}
    for release in chosen:
        todo = [i for i in ids if old is None or old.row(i, release) is None or old.row(i, release)["verdict"] in redo]
        if todo:
            plan[release] = todo
    return plan


def installed(releases: list[str], jobs: int) -> bool:
    """Install those of ``releases`` that are missing (as the release sweep does); False, having said why, where one
    could not be installed."""
    failed = sweep.install_releases(releases, jobs)
    for release, why in failed.items():
        print(f"ci.differential: DeepSpeed {release}: {why}", file=sys.stderr)
    return not failed


def sweep_releases() -> list[str]:
    """The releases of the release sweep's record (``fixes/data/sweep.json``): every release the Fixbook measures."""
    from fixes import measured

    return list(measured.read().releases)


def shard_plan(plan: dict[str, list[str]], shard: shards.Shard, old: record_module.Record) -> tuple[dict[str, list[str]], str]:
    """Part ``shard`` of ``plan``, cut over (release, cell) rows balanced by their recorded seconds."""
    units = [(release, cell) for release, cells in plan.items() for cell in cells]

    def seconds(unit: tuple[str, str]) -> float | None:
        row = old.row(unit[1], unit[0])
        return None if row is None else row.get("seconds")

    mine, method = shards.part(units, seconds, shard)
    part: dict[str, list[str]] = {}
    for release, cell in mine:
        part.setdefault(release, []).append(cell)
    return part, method


def unjudged(space: space_module.Space, cell: dict[str, Any]) -> dict[str, Any] | None:
    """The row of a cell the reference does not model (recorded without running), or None."""
    gaps = space.unmodelled(cell)
    if not gaps:
        return None
    return {"verdict": "could not run", "error": "reference does not model " + "; ".join(gaps)}


def measure(plan: dict[str, list[str]], design: design_module.Design, space: space_module.Space,
            cell_timeout: float, jobs: int, on_release: Callable[[dict[Row, dict[str, Any]]], None],
            progress: bool = True) -> dict[Row, dict[str, Any]]:
    """Every row of ``plan``; ``on_release`` gets each release's rows as soon as they are in."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm import tqdm

    cells = dict(zip(design.ids, design.cells))
    run = dict(space.run)
    results: dict[Row, dict[str, Any]] = {}

    def one(release: str, ids: list[str]) -> dict[Row, dict[str, Any]]:
        rows: dict[Row, dict[str, Any]] = {}
        runnable = {}
        for cell_id in ids:
            skipped = unjudged(space, cells[cell_id])
            if skipped is not None:
                rows[Row(cell_id, release)] = {**skipped, "command": record_module.repeat_command(cell_id, release)}
            else:
                runnable[cell_id] = {"cell": cells[cell_id]}
        if runnable:
            rows.update(run_release(release, runnable, run, cell_timeout))
        return rows

    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        with tqdm(total=sum(map(len, plan.values())), desc="differential", unit="row", disable=not progress,
                  file=sys.stderr) as bar:
            for future in as_completed([pool.submit(one, release, ids) for release, ids in plan.items()]):
                rows = future.result()
                results.update(rows)
                on_release(rows)
                verdicts = [row["verdict"] for row in rows.values()]
                bar.set_postfix_str(f"{next(iter(rows)).release if rows else ''}: " + ", ".join(
                    f"{verdicts.count(v)} {v}" for v in record_module.VERDICTS if v in verdicts))
                bar.update(len(rows))
    except BaseException:
        sweep.stop_children()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return results


# ---- attribution -------------------------------------------------------------------------------------------------

def attribute_release(release: str, data: record_module.Record, cell_ids: list[str], run: dict[str, Any],
                      cell_timeout: float, entries: list[attribute_module.Entry]) -> dict[str, dict[str, Any]]:
    """{cell id: attribution} for the differing/crashing rows of ``cell_ids`` on ``release``: each row with candidate
    entries re-run with their fixes applied and each differing row re-run as it was (one child; a difference must
    show twice), :func:`attribute_module.decide`; then, where several candidates' fixes made it agree together, each
    alone (a second child) and :func:`attribute_module.narrow`."""
    rows = {c: data.row(c, release) for c in cell_ids}
    rows = {c: row for c, row in rows.items() if row and row["verdict"] in attribute_module.ATTRIBUTED}
    tried = {c: attribute_module.candidates(data.cells[c]["cell"], release, entries) for c in rows}

    def child(items: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        if not items:
            return {}
        answers, failure = run_child(release, items, run, cell_timeout * len(items) + 60, cell_timeout)
        return {key: answers.get(key) or {"verdict": "could not run", "error": failure or "no answer"} for key in items}

    # one child: each row with its candidates' fixes, and each differing row (every crash without candidates) as it was
    both = child({**{f"{c}+fixes": {"cell": data.cells[c]["cell"], "apply": tried[c]} for c in rows if tried[c]},
                  **{c: {"cell": data.cells[c]["cell"]} for c, row in rows.items()
                     if row["verdict"] == "differs" or not tried[c]}})
    fixed = {c: both[f"{c}+fixes"] for c in rows if f"{c}+fixes" in both}
    again = {c: both[c] for c in rows if c in both}
    # several candidates made it agree together: which of them does alone (each one's fix on its own)
    several = [c for c in rows if len(tried[c]) > 1 and fixed.get(c, {}).get("verdict") == "agrees"]
    alone = child({f"{c}~{entry}": {"cell": data.cells[c]["cell"], "apply": [entry]} for c in several for entry in tried[c]})
    found = {}
    for c, row in rows.items():
        found[c] = attribute_module.decide(row, tried[c], fixed.get(c), again.get(c))
        if c in several:
            found[c] = attribute_module.narrow(found[c], {e: alone.get(f"{c}~{e}", {}) for e in tried[c]})
    return found


# ---- the record --------------------------------------------------------------------------------------------------

class Recorder(sweep.Recorder):
    """The release sweep's one-writer lock, saving differential rows (an atomic merge per release)."""

    def save_rows(self, cells: dict[str, dict[str, Any]], rows: dict[Row, dict[str, Any]],
                  last_run: dict[str, Any]) -> None:
        old = record_module.read(self.path)
        record_module.write(record_module.merge(old, cells, {(r.cell, r.release): row for r, row in rows.items()},
                                                last_run, importlib.metadata.version("torch"),
                                                platform.python_version()), self.path)


def cell_entries(design: design_module.Design) -> dict[str, dict[str, Any]]:
    return {cell_id: {"cell": cell, "origins": list(origins)}
            for cell_id, cell, origins in zip(design.ids, design.cells, design.origins)}


def merge_parts(base: record_module.Record, parts: list[tuple[Path, record_module.Record]]) -> record_module.Record:
    """``base`` with the rows of every part of one sharded run (``--shard``); raises :class:`sweep.MergeError` where
    a part is missing, twice, unfinished, or of another plan."""
    found: dict[int, tuple[Path, record_module.Record, dict[str, Any]]] = {}
    for path, data in parts:
        info = data.last_run.get("shard")
        if not isinstance(info, dict) or data.last_run.get("state") == "running":
            raise sweep.MergeError(f"{path} holds no finished part of a sharded run (made by "
                                   "`python -m ci.differential --shard I/N`, run to its end)")
        shard = shards.parse(str(info["part"]))
        if shard.index in found:
            raise sweep.MergeError(f"{found[shard.index][0]} and {path} are both part {shard}")
        found[shard.index] = (path, data, {**info, "count": shard.count})
    first_path, _, first_info = found[min(found)]
    for path, _, info in found.values():
        if info["count"] != first_info["count"] or info["plan"] != first_info["plan"]:
            raise sweep.MergeError(f"{path} is a part of another plan than {first_path}")
    rows_of = {index: [tuple(unit) for unit in info["rows"]] for index, (_, _, info) in found.items()}
    union = [unit for units in rows_of.values() for unit in units]
    shards.check_complete(rows_of, int(first_info["count"]), union, "ci.differential --merge")
    if shards.digest([list(unit) for unit in union]) != first_info["plan"]:
        raise sweep.MergeError("ci.differential --merge: the parts' rows do not make up their plan")
    merged = base
    for index, (path, data, _) in sorted(found.items()):
        rows = {}
        for cell_id, release in rows_of[index]:
            row = data.row(cell_id, release)
            if row is None:
                raise sweep.MergeError(f"{path} (part {index}) has no row for {cell_id} on {release}, which it measured")
            rows[(cell_id, release)] = row
        merged = record_module.merge(merged, data.cells, rows, None, data.torch, data.python)
    last = dict(found[min(found)][1].last_run)
    last.pop("shard", None)
    last.update(wall_s=max(float(d.last_run.get("wall_s", 0)) for _, d, _ in found.values()),
                runs=sum(int(d.last_run.get("runs", 0)) for _, d, _ in found.values()))
    merged.last_run = last
    return merged


def summary(data: record_module.Record, space: space_module.Space, design: design_module.Design) -> str:
    """The record in a few lines: the design (cells, pair coverage), the releases, the verdicts per release."""
    cover = design_module.coverage(space, design.cells)
    rows = list(data.all_rows())
    lines = [f"design: {len(design.cells)} cells ({sum('covering' not in o for o in design.origins)} from entries' "
             f"trigger cells); pair coverage {cover.covered}/{cover.required} required tuples"
             f"{' (complete)' if cover.complete else ' (INCOMPLETE)'}; "
             f"{sum(bool(space.unmodelled(c)) for c in design.cells)} cells hold a value the reference does not model",
             f"record: {len(rows)} rows of {len(data.rows)} cells on {len(data.releases)} release(s)"
             + (f" ({', '.join(data.releases)})" if data.releases else "")]
    for release in data.releases:
        found = record_module.counts(data, release)
        seconds = [row.get("seconds") for _, r, row in rows if r == release and row.get("seconds") is not None]
        lines.append(f"  {release}: " + ", ".join(f"{n} {v}" for v, n in found.items() if n) +
                     (f"; {sum(seconds):.0f} s in cells" if seconds else ""))
    total = record_module.counts(data)
    lines.append("all: " + ", ".join(f"{n} {v}" for v, n in total.items()))
    if data.last_run:
        run = data.last_run
        lines.append(f"last run: {run.get('at')}, {run.get('runs')} rows in {run.get('wall_s')} s"
                     + (f" ({run.get('rows_per_hour')} rows per hour)" if run.get("rows_per_hour") else ""))
    lines += attribution_summary(data)
    return "\n".join(lines)


def attribution_summary(data: record_module.Record) -> list[str]:
    """The attribution's counts: per release and in all, rows explained (by which entries), flaky, unexplained, and
    the differing/crashing rows not attributed yet."""
    pending = sum(row["verdict"] in attribute_module.ATTRIBUTED and data.attributed(c, r) is None
                  for c, r, row in data.all_rows())
    if not data.attribution:
        return [f"attribution: not recorded yet ({pending} differing/crashing rows; python -m ci.differential --attribute)"]
    lines = ["attribution of the differing/crashing rows (explained: the entries' triggers hold, their measured "
             "ranges hold the release, and with their fixes applied the cell agrees):"]
    for release in [*data.releases, None]:
        statuses, by_entry = attribute_module.counts(data.attribution, release)
        lines.append(f"  {release or 'all'}: " + ", ".join(f"{n} {s}" for s, n in statuses.items()))
    _, by_entry = attribute_module.counts(data.attribution)
    lines += [f"    explained by {entry}: {n} rows" for entry, n in by_entry.items()]
    covered = {(result["cell"], release) for result in data.minimised.values() for release in result["rows"]}
    unexplained = sum(a["status"] == "unexplained" and (c, r) not in covered
                      for c, by_release in data.attribution.items() for r, a in by_release.items())
    lines.append(f"  unexplained rows not minimised yet: {unexplained}; rows not attributed yet: {pending}")
    if data.minimised:
        lines.append(f"minimised: {len(data.minimised)} groups of unexplained rows (python -m ci.differential "
                     "--minimise), each its smallest configuration and the releases it shows on:")
        for key, result in data.minimised.items():
            showing = sum(sig == result["signature"] for sig in result.get("releases", {}).values())
            script = result.get("script", {})
            lines.append(f"  {key} {result['signature']}: {describe_set(result['set'])}; "
                         + (f"{result['first']} - {result['last']} ({showing} of {len(result['releases'])} releases)"
                            if result.get("first") else f"on none of {len(result.get('releases', {}))} releases")
                         + (f"; script {script['name']}" + ("" if script.get("matches") else " (printed otherwise)")
                            if script.get("checked") else ""))
        scripted = [r["script"] for r in data.minimised.values() if r.get("script", {}).get("checked")]
        lines.append(f"scripts: {len({s['name'] for s in scripted})} standalone scripts for {len(scripted)} of "
                     f"{len(data.minimised)} groups (python -m ci.differential --scripts); "
                     f"{sum(s['matches'] for s in scripted)} printed what the sweep recorded on the releases they ran on")
    return lines


def findings(data: record_module.Record) -> str:
    """Every differing, crashing and rejected row, one line each."""
    lines = []
    for cell_id, release, row in data.all_rows():
        if row["verdict"] in ("differs", "crashes", "rejected"):
            detail = (f"max diff {row.get('max_diff', float('nan')):.3g}, first at step {row.get('first_step')} in "
                      f"{row.get('quantity')} (outside: {', '.join(row.get('quantities', []))})"
                      if row["verdict"] == "differs" else row.get("error", ""))
            cell = data.cells.get(cell_id, {}).get("cell", {})
            lines.append(f"{cell_id} {release} {row['verdict']}: {detail}\n    {describe(cell)}")
    return "\n".join(lines)


def describe(cell: dict[str, Any]) -> str:
    """A cell in a line: its values that are not the space's defaults, and the four triple dimensions always."""
    space = space_module.load()
    always = set(design_module.TRIPLE)
    return ", ".join(f"{name}={value}" for name, value in cell.items()
                     if name in always or value != space.dimension(name).default)


# ---- main --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.differential", description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", help=f"release (repeatable; default: {', '.join(DEFAULT_RELEASES)})")
    parser.add_argument("--all-releases", action="store_true",
                        help="every release of the release sweep's record (fixes/data/sweep.json), with any --release")
    parser.add_argument("--cell", action="append", help="cell id (repeatable; default: every cell of the design)")
    parser.add_argument("--limit", type=int, help="the design's first N cells only")
    parser.add_argument("--resume", action="store_true", help="only the rows the record lacks or could not run (with "
                        "--minimise: only the groups not minimised before)")
    parser.add_argument("--redo", action="append", choices=record_module.VERDICTS, metavar="VERDICT",
                        help="with --resume: also re-measure the rows of this verdict (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="releases in parallel (default 1)")
    parser.add_argument("--timeout", type=float, default=CELL_TIMEOUT, help="seconds per cell")
    parser.add_argument("--out", type=Path, default=record_module.DATA)
    parser.add_argument("--design", action="store_true", help="print the design and its coverage; run nothing")
    parser.add_argument("--summary", action="store_true", help="print what the record says; run nothing")
    parser.add_argument("--findings", action="store_true", help="print every differing/crashing/rejected row")
    parser.add_argument("--shard", metavar="I/N", help="measure only part I of N of the plan")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="FILE", help="merge the parts' files into --out")
    parser.add_argument("--attribute", action="store_true",
                        help="explain the record's differing/crashing rows by entries (re-runs them with the fixes)")
    parser.add_argument("--minimise", action="store_true",
                        help="minimise the record's unexplained rows and run each minimal cell on every release")
    parser.add_argument("--scripts", action="store_true",
                        help="write each minimised group's standalone script and run it on the newest release it "
                             "fails on and the newest it agrees on; record what it printed (--resume: only those "
                             "not checked before)")
    parser.add_argument("--script", metavar="KEY", help="print the standalone script of minimised group KEY")
    parser.add_argument("--cross-check", action="store_true",
                        help="the grid against the catalogue: does each entry's bug show in its trigger cells on its "
                             "reproduce release? (reads the record; runs nothing)")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--child", metavar="FILE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        space = space_module.load()
    except space_module.SpaceError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    design = design_module.build(space)
    if args.design:
        cover = design_module.coverage(space, design.cells)
        for cell_id, cell, origins in zip(design.ids, design.cells, design.origins):
            print(f"{cell_id}  [{', '.join(origins)}]  {describe(cell)}")
        expressible = [t for t in design.triggers if t.cell is not None]
        print(f"{len(design.cells)} cells; entries' trigger cells: {len(expressible)} of {len(design.triggers)} "
              "expressible in the space")
        print(cover.proof())
        return 0 if cover.complete else 1
    if args.cross_check:
        found = cross_check(record_module.read(args.out), design)
        print("\n".join(line for result in found for line in [result.line()]))
        shown = sum(result.shown for result in found)
        print(f"{len(found)} entries with a trigger cell the space expresses; {shown} showed their bug in one on their "
              f"reproduce release; {len(found) - shown} did not (each with why, above)")
        return 0
    if args.summary or args.findings:
        data = record_module.read(args.out)
        print(summary(data, space, design) if args.summary else findings(data))
        return 0
    if args.merge:
        try:
            with Recorder(args.out):
                parts = [(path, record_module.read(path)) for path in args.merge]
                merged = merge_parts(record_module.read(args.out), parts)
                record_module.write(merged, args.out)
        except (sweep.SweepBusyError, sweep.MergeError, shards.ShardError, record_module.RecordError,
                FileNotFoundError) as exc:
            print(f"ci.differential: {exc}", file=sys.stderr)
            return 2
        print(f"merged {len(parts)} parts into {args.out}")
        print(summary(merged, space, design))
        return 0
    if args.script:
        data = record_module.read(args.out)
        if args.script not in data.minimised:
            print(f"ci.differential: no minimised group {args.script!r} (python -m ci.differential --summary lists "
                  "them)", file=sys.stderr)
            return 2
        found = {**data.minimised[args.script]}
        found.setdefault("script", {"run": dict(space.run)})
        print(standalone_script(found, data)[1], end="")
        return 0
    if args.scripts:
        return scripts_main(args, space)
    if args.attribute:
        return attribute_main(args, space)
    if args.minimise:
        return minimise_main(args, space)
    chosen = sorted(set((args.release or ([] if args.all_releases else list(DEFAULT_RELEASES)))
                        + (sweep_releases() if args.all_releases else [])), key=parse, reverse=True)
    try:
        shard = shards.parse(args.shard) if args.shard else None
        old = record_module.read(args.out)
        whole = plan_for(design, chosen, old if args.resume else None, args.cell, args.limit,
                         ("could not run", *(args.redo or ())))
    except (shards.ShardError, record_module.RecordError, ValueError) as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    plan, method = shard_plan(whole, shard, old) if shard is not None else (whole, "")
    if not installed(list(plan), args.jobs):  # a part installs only its own releases
        return 2
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    started = time.monotonic()
    running = {"at": stamp, "state": "running", "releases": chosen}
    cells = cell_entries(design)
    try:
        with Recorder(args.out) as recorder:
            results = measure(plan, design, space, args.timeout, args.jobs,
                              lambda rows: recorder.save_rows(cells, rows, running), not args.no_progress)
            wall = round(time.monotonic() - started, 1)
            judged = sum("reference does not model" not in row.get("error", "") for row in results.values())
            last_run = {"at": stamp, "wall_s": wall, "runs": len(results), "rows_run": judged, "releases": chosen,
                        "jobs": args.jobs, "cells": len(design.cells), "nice": os.nice(0),
                        "rows_per_hour": round(judged * 3600 / wall) if wall else None}
            if shard is not None:
                last_run["shard"] = {"part": str(shard), "plan": shards.digest([[c, r] for r, cs in whole.items() for c in cs]),
                                     "balanced_by": method, "rows": sorted([row.cell, row.release] for row in results)}
            recorder.save_rows(cells, {}, last_run)
    except sweep.SweepBusyError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ci.differential: interrupted; every release finished before it is saved in {args.out}", file=sys.stderr)
        return 130
    found = {v: sum(row["verdict"] == v for row in results.values()) for v in record_module.VERDICTS}
    print(f"{len(results)} rows in {wall:.0f} s ({judged} run, {last_run['rows_per_hour']} per hour): " +
          ", ".join(f"{n} {v}" for v, n in found.items() if n) + f"; written to {args.out}")
    return 0


def attribute_main(args: argparse.Namespace, space: space_module.Space) -> int:
    """``--attribute``: every differing/crashing row of the record (of ``--release``s, ``--cell``s) attributed,
    ``--jobs`` releases at a time, each release saved as it is done."""
    try:
        data = record_module.read(args.out)
    except record_module.RecordError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    chosen = sorted(set(args.release or data.releases), key=parse, reverse=True)
    if not installed(chosen, args.jobs):
        return 2
    entries = attribute_module.book_entries()
    cell_ids = sorted(args.cell or data.rows)
    started = time.monotonic()
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def one(release: str) -> tuple[str, dict[str, dict[str, Any]], float]:
        began = time.monotonic()
        return release, attribute_release(release, data, cell_ids, dict(space.run), args.timeout, entries), \
            time.monotonic() - began

    try:
        with Recorder(args.out), ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for done in as_completed([pool.submit(one, release) for release in chosen]):
                release, found, seconds = done.result()  # saved here, in this thread: one writer
                current = record_module.read(args.out)
                for cell_id, attribution in found.items():
                    current.attribution.setdefault(cell_id, {})[release] = attribution
                record_module.write(current, args.out)
                statuses, _ = attribute_module.counts({c: {release: a} for c, a in found.items()})
                print(f"{release}: {len(found)} rows in {seconds:.0f} s: " +
                      ", ".join(f"{n} {s}" for s, n in statuses.items() if n), flush=True)
    except sweep.SweepBusyError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    print(f"attributed in {time.monotonic() - started:.0f} s; written to {args.out}")
    return 0


def minimise_main(args: argparse.Namespace, space: space_module.Space) -> int:
    """``--minimise``: every group of unexplained rows (of ``--cell``s) minimised on its newest release, then every
    minimal cell on every release of the sweep (``--release``s: those only), ``--jobs`` releases at a time; saved
    into the record's ``minimised``."""
    from concurrent.futures import ThreadPoolExecutor

    from fixes import measured

    try:
        data = record_module.read(args.out)
    except record_module.RecordError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    found = [g for g in minimise_module.groups(data.rows, data.attribution) if not args.cell or g.cell_id in args.cell]
    known = {(result["cell"], result["signature"]): key for key, result in data.minimised.items()}
    if args.resume:  # a group minimised before (same cell, same failure) keeps its result; its rows are the new ones
        kept = {g.key: g for g in found if (g.cell_id, g.signature) in known}
        found = [g for g in found if g.key not in kept]
        print(f"{len(kept)} groups minimised before kept; {len(found)} to minimise")
    releases = sorted(args.release or measured.read().releases, key=parse)
    if not installed(sorted({*releases, *(g.newest for g in found)}, key=parse), args.jobs):
        return 2
    run = dict(space.run)
    entries = attribute_module.book_entries()
    started = time.monotonic()
    results: dict[str, dict[str, Any]] = {}

    def reduce(group: minimise_module.Group) -> dict[str, Any]:
        def on_release(cells: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
            answers, failure = run_child(group.newest, {k: {"cell": c} for k, c in cells.items()}, run,
                                         args.timeout * len(cells) + 60, args.timeout)
            return {k: answers.get(k) or {"verdict": "could not run", "error": failure or "no answer"} for k in cells}

        began = time.monotonic()
        done = minimise_module.minimise(data.cells[group.cell_id]["cell"], group.signature, on_release, space,
                                        known=lambda cell: attribute_module.candidates(cell, group.newest, entries))
        return {"cell": group.cell_id, "signature": group.signature, "rows": group.releases, "on": group.newest,
                "minimal": done.minimal, "set": done.set_values(space), "tries": done.tries,
                "seconds": round(time.monotonic() - began, 1)}

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:  # groups side by side, each on its release
        for group, result in zip(found, pool.map(reduce, found)):
            results[group.key] = result
            print(f"{group.key} ({group.signature} on {len(group.releases)} releases, newest {group.newest}): "
                  f"minimal {describe_set(result['set'])} in {len(result['tries'])} tries", flush=True)
    minimal_cells = {key: {"cell": result["minimal"]} for key, result in results.items()}

    def one(release: str) -> tuple[str, dict[Row, dict[str, Any]]]:
        return release, run_release(release, minimal_cells, run, args.timeout)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for release, rows in pool.map(one, releases if minimal_cells else []):
            for row, answer in rows.items():
                results[row.cell].setdefault("releases", {})[release] = minimise_module.signature(answer)
    for key, result in results.items():
        by_release = {r: result.get("releases", {})[r] for r in sorted(result.get("releases", {}), key=parse)}
        result["releases"] = by_release
        result["first"], result["last"] = minimise_module.release_range(by_release, result["signature"])
        print(f"{key}: {result['signature']} from {result['first']} to {result['last']} "
              f"({sum(sig == result['signature'] for sig in by_release.values())} of {len(by_release)} releases)")
    try:
        with Recorder(args.out):
            current = record_module.read(args.out)
            if args.resume:  # the groups as they are now: earlier results under their new keys, none for rows since explained
                earlier = {(r["cell"], r["signature"]): r for r in current.minimised.values()}
                others = {k: r for k, r in current.minimised.items() if args.cell and r["cell"] not in args.cell}
                current.minimised = {**others, **{key: {**earlier[(g.cell_id, g.signature)], "rows": g.releases}
                                                  for key, g in kept.items()}}
            else:  # the cells minimised again lose their earlier groups (their rows' failures may have changed)
                current.minimised = {k: r for k, r in current.minimised.items()
                                     if args.cell and r["cell"] not in args.cell}
            current.minimised.update(results)
            record_module.write(current, args.out)
    except sweep.SweepBusyError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    print(f"{len(results)} groups minimised in {time.monotonic() - started:.0f} s; written to {args.out}")
    return 0


def standalone_script(found: dict[str, Any], data: record_module.Record) -> tuple[str, str]:
    from fixes.harness import standalone

    return standalone.for_group(found, data.torch, data.python)


def scripts_main(args: argparse.Namespace, space: space_module.Space) -> int:
    """``--scripts``: every minimised group's standalone script (one per minimal cell) run on
    :func:`minimise_module.script_releases`, ``--jobs`` at a time; what each printed saved into the record."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        data = record_module.read(args.out)
    except record_module.RecordError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    run = dict(space.run)
    chosen = {key: {**found, "script": {**found.get("script", {}), "run": run}}
              for key, found in data.minimised.items() if not args.cell or found["cell"] in args.cell}
    if args.resume:
        chosen = {key: found for key, found in chosen.items() if not found["script"].get("checked")}
    todo: dict[tuple[str, str], tuple[str, str]] = {}  # (script name, release) -> (text, release)
    names = {}
    for key, found in chosen.items():
        name, text = standalone_script(found, data)
        names[key] = name
        for release in minimise_module.script_releases(found):
            todo[(name, release)] = (text, release)
    if not installed(sorted({release for _, release in todo}, key=parse), args.jobs):
        return 2
    started = time.monotonic()

    def one(item: tuple[tuple[str, str], tuple[str, str]]) -> tuple[tuple[str, str], str]:
        (name, release), (text, _) = item
        with tempfile.TemporaryDirectory(prefix="fixbook-script-") as scratch:
            path = Path(scratch) / name
            path.write_text(text)
            try:
                # a plain interpreter, as a user runs it (the script spawns its own ranks)
                done = subprocess.run([sys.executable, str(path)], cwd=scratch, capture_output=True, text=True,
                                      timeout=args.timeout * 3,
                                      env={**os.environ, **release_env.environment(release)})
            except subprocess.TimeoutExpired:
                return (name, release), "timed out"
        return (name, release), minimise_module.printed_verdict(done.stdout)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        printed = dict(pool.map(one, todo.items()))
    try:
        with Recorder(args.out):
            current = record_module.read(args.out)
            for key, found in chosen.items():
                checked = {release: printed[(names[key], release)] for release in minimise_module.script_releases(found)}
                matches = all(minimise_module.same_outcome(verdict, found["releases"].get(release))
                              for release, verdict in checked.items())
                current.minimised[key]["script"] = {"name": names[key], "run": found["script"]["run"],
                                                    "checked": checked, "matches": matches}
                print(f"{key}: {names[key]}: " + ", ".join(f"{r} {v}" for r, v in checked.items())
                      + ("" if matches else "  (not what the sweep recorded: "
                         + ", ".join(f"{r} {found['releases'].get(r)}" for r in checked) + ")"), flush=True)
            record_module.write(current, args.out)
    except sweep.SweepBusyError as exc:
        print(f"ci.differential: {exc}", file=sys.stderr)
        return 2
    matching = sum(current.minimised[key]["script"]["matches"] for key in chosen)
    print(f"{len(set(names.values()))} scripts for {len(chosen)} groups, {len(todo)} runs in "
          f"{time.monotonic() - started:.0f} s: {matching} of {len(chosen)} groups' scripts printed what the sweep "
          f"recorded; written to {args.out}")
    return 0


def describe_set(values: dict[str, Any]) -> str:
    """A minimal cell's values away from the defaults, as ``name=value, ...`` ("every default" when none)."""
    return ", ".join(f"{name}={value}" for name, value in values.items()) or "every default"


@dataclass(frozen=True)
class CrossCheck:
    """One entry's expressible trigger cells (those its grid recorded as showing the bug) on its reproduce release."""

    entry: str
    release: str
    cells: tuple[str, ...]
    shown: bool
    why: str  # what the rows say: the explaining row, or why none showed it

    def line(self) -> str:
        return f"{self.entry} on {self.release}: {'shows' if self.shown else 'does not show'} its bug: {self.why}"


def cross_check(data: record_module.Record, design: design_module.Design) -> list[CrossCheck]:
    """For every entry with a trigger cell the space expresses and its grid recorded as reproducing: whether the
    record shows the bug there on the entry's reproduce release (a differing or crashing row the attribution explains
    by the entry, or, not attributed yet, any differing or crashing row), and if not, what the rows say instead."""
    import json

    from fixes import registry
    from fixes.trigger import GRIDS

    grids = json.loads(Path(GRIDS).read_text()).get("entries", {})
    showing: dict[str, list[str]] = {}
    for trigger in design.triggers:
        recorded = next((c for c in grids.get(trigger.entry, {}).get("cells", []) if c["label"] == trigger.label), {})
        if trigger.cell is not None and recorded.get("reproduced"):
            cell = design_module.cell_id(trigger.cell)
            if cell not in showing.setdefault(trigger.entry, []):
                showing[trigger.entry].append(cell)
    found = []
    for entry, cells in sorted(showing.items()):
        release = registry.get(entry).info.reproduce_release
        seen = []
        shown, why = False, ""
        for cell in cells:
            row = data.row(cell, release)
            if row is None:
                seen.append(f"{cell} not measured on {release}")
                continue
            attribution = data.attributed(cell, release) or {}
            if row["verdict"] in attribute_module.ATTRIBUTED and (
                    entry in attribution.get("entries", ()) or not attribution):
                shown, why = True, (f"{cell} {row['verdict']}" + (f", explained by {', '.join(attribution['entries'])}"
                                                                   if attribution else ", not attributed yet"))
                break
            status = attribution.get("status")
            seen.append(f"{cell} {row['verdict']}" + (f" ({status}" + (f": {', '.join(attribution.get('entries', []))}"
                                                                         if attribution.get("entries") else "") + ")"
                                                       if status else ""))
        found.append(CrossCheck(entry, release, tuple(cells), shown, why or "; ".join(seen)))
    return found
