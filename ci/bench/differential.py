"""What the differential sweep costs, read from its record (``fixes/data/differential.json``): the last run's rows per
hour on this machine, the time the whole grid spends in cells, and how the four parts of the GitHub matrix
(``--shard I/4``, balanced by the rows' recorded seconds) split it. Nothing is run: every figure is a measured run's.

    python -m ci.bench --section differential
"""
from __future__ import annotations

from typing import Any

PARTS = 4  # the GitHub workflow's matrix


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
