"""Carry measured rows over a change of form alone.

    python -m ci.sweep.restamp --since REV            # rows measured with REV's entry code take today's stamp
    python -m ci.sweep.restamp --since REV --check    # what it would carry over, writing nothing

Every sweep row and trigger grid records the entry code it was measured with (:func:`fixes.measured.entry_code`,
:func:`ci.sweep.triggers.grid_code`): a hash of the files' bytes, so any edit makes the entry's rows stale and
``ci.sweep --resume`` measures them again. An edit that changes nothing that runs need not cost that. An entry's
code at ``REV`` and in this checkout have the same *form* when

* each module of its package has the same syntax tree once docstrings are dropped (comments and layout are not in
  the tree); a class's ``info = FixInfo(...)`` statement and the ``FixInfo`` name it imports are left out,
* its metadata is the same (every field of its ``FixInfo``, whether stated in ``__init__.py`` or ``info.toml``),
* its recorded fingerprints are the same, and, for a trigger grid, its ``trigger.py`` has the same tree.

Only then is a row whose stamp is ``REV``'s stamp of that entry given this checkout's stamp; a row measured with
older code stays stale, and so does every row of an entry whose form changed. Each side's stamps are computed by
that side's own code (``REV``'s tree is read from git into a temporary directory).
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# Run in a child Python with a tree's root first on sys.path: that tree's stamps, and the form computed by this file.
_CHILD = """
import importlib, json, sys
from dataclasses import asdict
sys.path.insert(0, sys.argv[1])
import runpy
form = runpy.run_path(sys.argv[2])["form_of"]
import fixes
from fixes import fingerprints, measured
grid_code = None
for name in ("ci.sweep.triggers", "ci.triggers"):
    try:
        grid_code = importlib.import_module(name).grid_code
        break
    except ImportError:
        continue
out = {}
for fix in fixes.all_fixes():
    package = fixes.__path__[0] + "/entries/" + fix.id.replace("-", "_")
    out[fix.id] = {"code": measured.entry_code(fix.id), "grid": grid_code(fix.id) if grid_code else None,
                   "form": form(package, asdict(fix.info), fingerprints.recorded(fix.id)),
                   "trigger": form(package, {}, {}, trigger=True)}
print(json.dumps({"root": fixes.__file__, "entries": out}))
"""


def _without_docstring(body: list[ast.stmt]) -> list[ast.stmt]:
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[1:]
    return body


class _Form(ast.NodeTransformer):
    """Drops what does not run: docstrings, and the metadata statement (compared as values instead)."""

    def generic_visit(self, node: ast.AST) -> ast.AST:
        node = super().generic_visit(node)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            node.body = _without_docstring(node.body) or [ast.Pass()]
        if isinstance(node, ast.ClassDef):
            node.body = [stmt for stmt in node.body if not _is_info(stmt)] or [ast.Pass()]
        return node

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | None:
        node.names = [alias for alias in node.names if alias.name != "FixInfo"]
        return node if node.names else None


def _is_info(stmt: ast.stmt) -> bool:
    return (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id == "info" and isinstance(stmt.value, ast.Call)
            and getattr(stmt.value.func, "id", "") == "FixInfo")


def module_form(source: str) -> str:
    """A module's syntax tree without docstrings, its ``info = FixInfo(...)`` and its import of ``FixInfo``."""
    return ast.dump(_Form().visit(ast.parse(source)), include_attributes=False)


def form_of(package: str, info: dict[str, Any], recorded: dict[str, Any], trigger: bool = False) -> str:
    """The form of an entry's package (its modules but ``trigger.py``, its metadata and fingerprints), or with
    ``trigger`` of its ``trigger.py`` alone, as one JSON text."""
    import hashlib

    modules = sorted(Path(package).glob("*.py"))
    chosen = [m for m in modules if (m.name == "trigger.py") == trigger]
    parts = {m.name: module_form(m.read_text()) for m in chosen}
    text = json.dumps({"modules": parts, "info": info, "fingerprints": recorded}, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()


def stamps(tree: Path) -> dict[str, dict[str, Any]]:
    """Each entry of the checkout at ``tree``: its stamps as that tree computes them, and its form."""
    done = subprocess.run([sys.executable, "-c", _CHILD, str(tree), __file__], capture_output=True, text=True,
                          timeout=300, cwd=tree)
    if done.returncode != 0:
        raise RuntimeError(f"reading the entries of {tree} failed: {done.stderr[-1500:]}")
    found = json.loads(done.stdout)
    if not Path(found["root"]).resolve().is_relative_to(tree.resolve()):  # an installed fixes shadowed the tree's
        raise RuntimeError(f"reading the entries of {tree} imported {found['root']} instead")
    return found["entries"]


def stamps_at(rev: str) -> dict[str, dict[str, Any]]:
    """:func:`stamps` of the commit ``rev`` of this repository."""
    from .. import ROOT  # imported here: a child process runs this file alone for form_of

    with tempfile.TemporaryDirectory(prefix="fixbook-restamp-") as work:
        archive = subprocess.run(["git", "archive", rev, "fixes", "ci"], cwd=ROOT, capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", work], input=archive.stdout, check=True)
        return stamps(Path(work))


@dataclass
class Carried:
    """What a restamp carries over: per entry, the sweep rows and the trigger grid given the new stamp."""

    rows: dict[str, int]
    grids: list[str]


def plan(old: dict[str, dict[str, Any]], new: dict[str, dict[str, Any]]) -> tuple[dict[str, tuple[str, str]],
                                                                               dict[str, tuple[str, str]], list[str]]:
    """(row stamps to map {entry: (old, new)}, grid stamps likewise, entries whose form changed)."""
    rows, grids, changed = {}, {}, []
    for entry, now in new.items():
        before = old.get(entry)
        if before is None or before["code"] == now["code"] and before["grid"] == now["grid"]:
            continue
        if before["form"] != now["form"]:
            changed.append(entry)
            continue
        if before["code"] != now["code"]:
            rows[entry] = (before["code"], now["code"])
        if before["grid"] and before["trigger"] == now["trigger"] and before["grid"] != now["grid"]:
            grids[entry] = (before["grid"], now["grid"])
    return rows, grids, sorted(changed)


def carry(rows: dict[str, tuple[str, str]], grids: dict[str, tuple[str, str]], *, write: bool,
          sweep_path: Path | None = None, grids_path: Path | None = None) -> Carried:
    """Give the rows (every environment) and grids stamped with an old stamp the new one; with ``write``, save."""
    from fixes import measured
    from fixes.files import locked, write_atomic
    from fixes.trigger import GRIDS

    sweep_path, grids_path = sweep_path or measured.DATA, grids_path or GRIDS
    counts: dict[str, int] = {}
    data = measured.read(sweep_path)
    for sweep in [data, *data.environments.values()]:
        for entry, (before, after) in rows.items():
            found = sweep.results.get(entry)
            if found is None:
                continue
            for release, row in list(found.observations.items()):
                if row.code == before:
                    found.observations[release] = replace(row, code=after)
                    counts[entry] = counts.get(entry, 0) + 1
    carried_grids = []
    with locked(grids_path):
        recorded = json.loads(grids_path.read_text()) if grids_path.exists() else {"entries": {}}
        for entry, (before, after) in grids.items():
            grid = recorded["entries"].get(entry)
            if grid and grid.get("code") == before:
                grid["code"] = after
                carried_grids.append(entry)
        if write and carried_grids:
            write_atomic(grids_path, json.dumps(recorded, indent=1) + "\n")
    if write and counts:
        measured.write(data, sweep_path)
    return Carried(counts, carried_grids)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.sweep.restamp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--since", required=True, help="the commit the rows were measured with (e.g. HEAD)")
    parser.add_argument("--check", action="store_true", help="say what would be carried over; write nothing")
    args = parser.parse_args(argv)
    from .. import ROOT

    rows, grids, changed = plan(stamps_at(args.since), stamps(ROOT))
    done = carry(rows, grids, write=not args.check)
    verb = "would carry" if args.check else "carried"
    for entry in sorted(set(rows) | set(grids)):
        print(f"{entry}: {verb} {done.rows.get(entry, 0)} rows{' and its trigger grid' if entry in done.grids else ''}")
    for entry in changed:
        print(f"{entry}: its code changed since {args.since}: its rows stay stale (python -m ci.sweep --resume "
              f"--entry {entry})")
    print(f"{sum(done.rows.values())} rows and {len(done.grids)} grids {verb} over; {len(changed)} entries changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
