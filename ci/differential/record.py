"""The differential sweep's record, ``fixes/data/differential.json``: every (cell, release) verdict, the cells
themselves, and the runs that wrote them.

    {"format": 1,
     "cells": {CELL_ID: {"cell": {dimension: value}, "origins": ["covering" | "trigger ENTRY", ...]}},
     "rows": {CELL_ID: {RELEASE: {"verdict": ..., "max_diff": ..., "first_step": ..., "quantity": ...,
                                 "quantities": [...], "error": ..., "seconds": ..., "command": ...}}},
     "releases": [...], "torch": ..., "python": ..., "last_run": {...},
     "attribution": {CELL_ID: {RELEASE: {"status": "explained" | "unexplained" | "flaky", "entries": [...], ...}}},
     "minimised": {CELL_ID~N: {"signature": ..., "minimal": {...}, "first": RELEASE, "last": RELEASE, ...}}}

``attribution`` is written by ``python -m ci.differential --attribute`` (:mod:`ci.differential.attribute`); a row
measured again loses its attribution (it judged the old row). ``minimised`` is written by ``--minimise``
(:mod:`ci.differential.minimise`): the unexplained rows' smallest configurations and the releases they show on.

Rows of a later run replace the rows it measured and keep every other; a cell dropped from the design keeps its
rows until the file is rewritten by a full run. Written atomically (:func:`fixes.files.write_atomic`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from fixes.files import write_atomic
from fixes.versions import parse

from .. import ROOT

DATA = ROOT / "fixes" / "data" / "differential.json"
FORMAT = 1
VERDICTS = ("agrees", "differs", "crashes", "rejected", "could not run")


class RecordError(ValueError):
    """The record file is not one ``python -m ci.differential`` wrote."""


def repeat_command(cell_id: str, release: str) -> str:
    """The command that measures one row again (and merges it into the file)."""
    return f"python -m ci.differential --cell {cell_id} --release {release}"


@dataclass
class Record:
    cells: dict[str, dict[str, Any]] = field(default_factory=dict)
    rows: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    releases: list[str] = field(default_factory=list)
    torch: str = ""
    python: str = ""
    last_run: dict[str, Any] = field(default_factory=dict)
    attribution: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    minimised: dict[str, dict[str, Any]] = field(default_factory=dict)

    def attributed(self, cell_id: str, release: str) -> dict[str, Any] | None:
        return self.attribution.get(cell_id, {}).get(release)

    def row(self, cell_id: str, release: str) -> dict[str, Any] | None:
        return self.rows.get(cell_id, {}).get(release)

    def all_rows(self) -> Iterable[tuple[str, str, dict[str, Any]]]:
        for cell_id in sorted(self.rows):
            for release in sorted(self.rows[cell_id], key=parse):
                yield cell_id, release, self.rows[cell_id][release]

    def as_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "releases": self.releases, "torch": self.torch, "python": self.python,
                "last_run": self.last_run,
                "cells": {key: self.cells[key] for key in sorted(self.cells)},
                "rows": {key: {release: self.rows[key][release] for release in sorted(self.rows[key], key=parse)}
                         for key in sorted(self.rows)},
                "attribution": {key: {release: self.attribution[key][release]
                                      for release in sorted(self.attribution[key], key=parse)}
                                for key in sorted(self.attribution) if self.attribution[key]},
                "minimised": {key: self.minimised[key] for key in sorted(self.minimised)}}


def read(path: Path = DATA) -> Record:
    """The record at ``path`` (an empty one where there is no file yet)."""
    if not path.exists():
        return Record()
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise RecordError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RecordError(f"{path} is not a differential record of format {FORMAT}")
    for cell_id, by_release in data.get("rows", {}).items():
        for release, row in by_release.items():
            if row.get("verdict") not in VERDICTS:
                raise RecordError(f"{path}: {cell_id} on {release} has verdict {row.get('verdict')!r}; "
                                  f"known: {', '.join(VERDICTS)}")
    return Record(dict(data.get("cells", {})), {k: dict(v) for k, v in data.get("rows", {}).items()},
                  list(data.get("releases", [])), data.get("torch", ""), data.get("python", ""),
                  dict(data.get("last_run", {})), {k: dict(v) for k, v in data.get("attribution", {}).items()},
                  {k: dict(v) for k, v in data.get("minimised", {}).items()})


def write(record: Record, path: Path = DATA) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(record.as_json(), indent=1, sort_keys=False) + "\n")


def merge(old: Record, cells: Mapping[str, Mapping[str, Any]], rows: Mapping[tuple[str, str], Mapping[str, Any]],
          last_run: Mapping[str, Any] | None = None, torch: str = "", python: str = "") -> Record:
    """``old`` with ``cells`` added and ``rows`` ({(cell id, release): row}) replacing theirs."""
    merged = Record({**old.cells, **{k: dict(v) for k, v in cells.items()}},
                    {k: dict(v) for k, v in old.rows.items()}, list(old.releases), torch or old.torch,
                    python or old.python, dict(last_run) if last_run is not None else dict(old.last_run),
                    {k: dict(v) for k, v in old.attribution.items()}, {k: dict(v) for k, v in old.minimised.items()})
    for (cell_id, release), row in rows.items():
        if cell_id not in merged.cells:
            raise RecordError(f"a row of cell {cell_id} on {release} names no recorded cell")
        merged.rows.setdefault(cell_id, {})[release] = dict(row)
        merged.attribution.get(cell_id, {}).pop(release, None)  # it judged the row this one replaces
    merged.releases = sorted({*merged.releases, *(release for _, release in rows)}, key=parse)
    return merged


def counts(record: Record, release: str | None = None) -> dict[str, int]:
    found = {verdict: 0 for verdict in VERDICTS}
    for _, row_release, row in record.all_rows():
        if release is None or row_release == release:
            found[row["verdict"]] += 1
    return found
