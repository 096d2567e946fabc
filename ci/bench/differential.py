"""What the differential sweep costs, read from its record (``fixes/data/differential.json``): the last run's rows per
hour on this machine, the time the whole grid spends in cells, and how the four parts of the GitHub matrix
(``--shard I/4``, balanced by the rows' recorded seconds) split it. Nothing is run: every figure is a measured run's.
``--section differential-parts`` runs the matrix's four parts here, one after the other, each end to end as a
matrix job runs it (every cell on every release of the record, ``--jobs 2``, its rows into a copy of the record),
and records each part's wall time: the matrix's wall time is its slowest part's.

    python -m ci.bench --section differential
    python -m ci.bench --section differential-parts
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

PARTS = 4  # the GitHub workflow's matrix (.github/workflows/differential.yml)
PART_JOBS = 2  # releases at a time in one part, as the workflow runs it


def cost() -> dict[str, Any]:
    from ci import differential
    from ci.differential import record as record_module
    from ci.notebooks import shards

    data = record_module.read()
    rows = [(cell, release, row) for cell, release, row in data.all_rows()]
    timed = [row["seconds"] for _, _, row in rows if row.get("seconds") is not None]
    plan = {}
    for cell, release, _ in rows:
        plan.setdefault(release, []).append(cell)
    parts = []
    for index in range(1, PARTS + 1):
        part, _ = differential.shard_plan(plan, shards.parse(f"{index}/{PARTS}"), data)
        parts.append(round(sum((data.row(c, r) or {}).get("seconds") or 0.0 for r, cs in part.items() for c in cs), 1))
    last = data.last_run
    return {"record_at": last.get("at"), "cells": len(data.cells), "releases": len(data.releases), "rows": len(rows),
            "rows_timed": len(timed), "cell_seconds": round(sum(timed), 1),
            "last_run": {key: last.get(key) for key in ("at", "wall_s", "runs", "rows_run", "jobs", "rows_per_hour",
                                                       "nice")},
            "parts": parts}


def page_lines(figures: dict[str, Any]) -> list[str]:
    run = figures["last_run"]
    hours = figures["cell_seconds"] / 3600
    return ["## The differential sweep", "",
            f"From the record as committed ({figures['rows']} rows: {figures['cells']} cells on {figures['releases']} "
            f"releases). Its last run, {run['at']}: {run['runs']} rows ({run['rows_run']} run, the rest recorded "
            f"without running: values the reference does not model) in {run['wall_s']} s with {run['jobs']} "
            f"releases at a time on this machine, {run['rows_per_hour']} rows per hour. Over the whole record the "
            f"cells' own times add up to {figures['cell_seconds']} s ({hours:.2f} CPU-hours at one cell per core; rows "
            f"measured in earlier runs under other load count as measured). The four parts of GitHub's matrix "
            f"(`--shard I/4`, balanced by those times) hold {', '.join(f'{s} s' for s in figures['parts'])} of cell "
            "time each: a part's wall time there is its cell time plus one process start per release, not measured "
            "on GitHub here.", ""]


def measure_parts(jobs: int = PART_JOBS) -> dict[str, Any]:
    """Each of the matrix's :data:`PARTS` parts run end to end on this machine, one after the other (each part's own
    process, as a matrix job runs ``python -m ci.differential --all-releases --shard I/N``); every part writes into its
    own copy of the record, the committed one is left as it was. Returns each part's wall time, rows and exit."""
    from ci import ROOT
    from ci.differential import record as record_module

    data = record_module.read()
    started_at = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    parts = []
    with tempfile.TemporaryDirectory(prefix="fixbook-parts-") as scratch:
        for index in range(1, PARTS + 1):
            out = Path(scratch) / f"part{index}.json"
            shutil.copyfile(record_module.DATA, out)
            command = [sys.executable, "-m", "ci.differential", "--all-releases", "--shard", f"{index}/{PARTS}",
                       "--jobs", str(jobs), "--out", str(out), "--no-progress"]
            load = os.getloadavg()[0]
            began = time.monotonic()
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            wall = round(time.monotonic() - began, 1)
            last = record_module.read(out).last_run if done.returncode == 0 else {}
            parts.append({"part": f"{index}/{PARTS}", "wall_s": wall, "exit": done.returncode,
                          "load_start": round(load, 2), "load_end": round(os.getloadavg()[0], 2),
                          "rows": len(last.get("shard", {}).get("rows", [])),
                          "said": (done.stdout.strip().splitlines() or [""])[-1][-200:].replace(scratch + "/", "")})
            print(f"part {index}/{PARTS}: {wall} s, exit {done.returncode}, {parts[-1]['rows']} rows", flush=True)
    return {"at": started_at, "releases": len(data.releases), "cells": len(data.cells), "jobs": jobs,
            "cpus": os.cpu_count(), "parts": parts, "matrix_wall_s": max(p["wall_s"] for p in parts)}


def parts_lines(figures: dict[str, Any]) -> list[str]:
    walls = ", ".join(f"{p['wall_s']} s for {p['rows']} rows ({round(p['rows'] * 3600 / p['wall_s'])} per hour; load "
                      f"average {p.get('load_start', '?')} at its start)" for p in figures["parts"])
    failed = [p["part"] for p in figures["parts"] if p["exit"] != 0]
    return [f"The four parts run here end to end, one after the other ({figures['at']}; each part every cell of its "
            f"share on its releases, {figures['jobs']} releases at a time, on this {figures['cpus']}-CPU machine with "
            f"the releases installed): {walls}. The matrix runs its parts side by side, so its wall time is its "
            f"slowest part's: {figures['matrix_wall_s']} s, plus each job's set-up (installing the part's releases)."
            + (f" Parts that failed: {', '.join(failed)}." if failed else ""), ""]
