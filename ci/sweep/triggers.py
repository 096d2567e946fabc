"""The trigger grids, measured: where each entry's bug shows around its trigger.

    python -m ci.sweep.triggers             # every entry whose grid is missing or measured with other code
    python -m ci.sweep.triggers --entry ID  # one entry (again)
    python -m ci.sweep.triggers --check     # exit 1 where a trigger disagrees with its grid, or a grid is missing/stale

Each entry's ``reproduce.trigger_cells()`` (``fixes.harness.Cell``) lists jobs around its trigger: the job with every
condition, then each condition flipped on its own. Here every cell runs on the entry's reproduce release, in a child
process of that release, and ``fixes/data/triggers.json`` keeps the job each cell ran and whether the bug showed.
A trigger (``fixes/entries/<id>/trigger.py``) must agree with every cell measured: a disagreement names the cell.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import ROOT
from .. import releases as release_env
from ..processes import zygote

MARK = "FIXBOOK-TRIGGER "
TIMEOUT_S = 900.0


def grid_code(entry_id: str) -> str:
    """A short hash of what a grid depends on: the entry's code (:func:`fixes.measured.entry_code`) and its
    ``trigger.py``."""
    from fixes import measured

    package = ROOT / "fixes" / "entries" / entry_id.replace("-", "_")
    trigger = package / "trigger.py"
    digest = hashlib.sha256(measured.entry_code(entry_id).encode())
    digest.update(trigger.read_bytes() if trigger.exists() else b"")
    return digest.hexdigest()[:12]


def child_main(entry_id: str) -> int:
    """In the release's process: run each cell, print one marked line per cell as it ends."""
    from ..processes.kernel_server import start_rank_server

    start_rank_server()  # before anything is set up: the ranks' launches fork from this state
    import fixes
    from fixes import harness
    from fixes.trigger import job_to_record

    harness.setup()
    module = importlib.import_module(f"fixes.entries.{entry_id.replace('-', '_')}.reproduce")
    with fixes.get(entry_id).measurement_context():  # what the sweep's check runs under (fp16 on CPU, say)
        cells = list(module.trigger_cells())
    for cell in cells:
        started = time.monotonic()
        line: dict[str, Any] = {"label": cell.label, "flips": cell.flips, "job": job_to_record(cell.job)}
        try:
            with fixes.get(entry_id).measurement_context():
                line.update(reproduced=bool(cell.run()), error="")
        except Exception as exc:  # noqa: BLE001 - a cell that cannot tell is recorded as such, the next one runs
            line.update(reproduced=None, error=f"{type(exc).__name__}: {exc}"[:300])
        line["seconds"] = round(time.monotonic() - started, 1)
        print(MARK + json.dumps(line), flush=True)
    return 0


def environment_of(entry_id: str) -> str:
    """Where the entry's grid runs: ``TRIGGER_ENVIRONMENT = "<name>"`` in its ``reproduce.py`` (an environment of
    ``ci/environments.toml``, e.g. an old torch the bug needs), else the project venv (``cpu``)."""
    import re

    from fixes import measured

    source = (ROOT / "fixes" / "entries" / entry_id.replace("-", "_") / "reproduce.py").read_text()
    found = re.search(r"""^TRIGGER_ENVIRONMENT\s*=\s*["']([\w.-]+)["']""", source, re.MULTILINE)
    return found.group(1) if found else measured.DEFAULT_ENVIRONMENT


def measure(entry_id: str, timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """The entry's grid on its reproduce release (a child process of that release, in its environment)."""
    import os
    import subprocess

    import fixes
    from fixes import measured

    from ..releases import environments

    fix = fixes.get(entry_id)
    release = fix.info.reproduce_release
    environment = environment_of(entry_id)
    release_env.install(release)
    if environment == measured.DEFAULT_ENVIRONMENT:
        python, selected = sys.executable, {**release_env.environment(release), "DS_ACCELERATOR": "cpu"}
    else:
        chosen = environments.require(environment)
        python, selected = str(chosen.executable), environments.variables(chosen, release)
    env = {**os.environ, **selected}
    done = subprocess.run([*zygote.command(python, env), "-m", "ci.sweep.triggers", "--child", entry_id], env=env, cwd=ROOT,
                          timeout=timeout, capture_output=True, text=True)
    cells = [json.loads(line[len(MARK):]) for line in done.stdout.splitlines() if line.startswith(MARK)]
    if not cells:
        raise RuntimeError(f"{entry_id} on {release}: no cell ran (exit {done.returncode}): {done.stderr[-800:]}")
    return {"release": release, "environment": environment,
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "code": grid_code(entry_id),
            "seconds": round(sum(cell.pop("seconds") for cell in cells), 1), "cells": cells}


def record(entry_id: str, grid: dict[str, Any], path: Path | None = None) -> None:
    from fixes.files import locked, write_atomic
    from fixes.trigger import GRIDS

    path = path or GRIDS
    with locked(path):
        data = json.loads(path.read_text()) if path.exists() else {"entries": {}}
        data["entries"][entry_id] = grid
        data["entries"] = dict(sorted(data["entries"].items()))
        write_atomic(path, json.dumps(data, indent=1) + "\n")


def problems(entries: list[str] | None = None) -> list[str]:
    """Every entry without a trigger, without a grid, with a grid measured with other code, or whose trigger
    disagrees with a measured cell."""
    import fixes
    from fixes.trigger import recorded_grid

    found = []
    for fix in fixes.all_fixes():
        if entries and fix.id not in entries:
            continue
        trigger = fix.trigger
        if trigger is None:
            found.append(f"{fix.id}: no trigger (fixes/entries/{fix.id.replace('-', '_')}/trigger.py)")
            continue
        grid = recorded_grid(fix.id, trigger)
        if grid is None:
            found.append(f"{fix.id}: no measured grid (python -m ci.sweep.triggers --entry {fix.id})")
            continue
        if grid.code != grid_code(fix.id):
            found.append(f"{fix.id}: the grid was measured with other code (python -m ci.sweep.triggers --entry {fix.id})")
        base = [cell for cell in grid.cells if not cell.flips]
        if not base or base[0].reproduced is not True:
            found.append(f"{fix.id}: the grid's job with every condition did not reproduce the bug")
        found += [f"{fix.id}: {text}" for text in grid.disagreements]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.sweep.triggers", description=__doc__.splitlines()[0])
    parser.add_argument("--entry", action="append", help="entry id (repeatable; default: missing or stale grids)")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.check:
        found = problems(args.entry)
        for problem in found:
            print(problem, file=sys.stderr)
        return 1 if found else 0
    import fixes
    from fixes.trigger import recorded_grid

    chosen = args.entry or [f.id for f in fixes.all_fixes()
                            if f.trigger is not None and ((grid := recorded_grid(f.id, f.trigger)) is None
                                                          or grid.code != grid_code(f.id))]
    failed = 0
    for entry_id in chosen:
        try:
            grid = measure(entry_id)
        except Exception as exc:  # noqa: BLE001 - the next entry still runs
            print(f"{entry_id}: {exc}", file=sys.stderr)
            failed += 1
            continue
        record(entry_id, grid)
        fix = fixes.get(entry_id)
        measured_grid = recorded_grid(entry_id, fix.trigger)
        assert measured_grid is not None
        print(f"{entry_id} on {grid['release']}: {len(grid['cells'])} cells in {grid['seconds']} s")
        for cell in measured_grid.cells:
            print(f"  {'agrees' if cell.agrees else 'DISAGREES' if cell.agrees is False else 'could not run'}: "
                  f"{cell.label}: reproduced={cell.reproduced} trigger={cell.predicted}"
                  + (f" ({cell.error})" if cell.error else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
