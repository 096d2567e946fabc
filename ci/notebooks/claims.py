"""The claims a notebook shows, re-checked with nbval's rules against a committed reference.

Papermill proves that a notebook still runs and asserts; this proves that what its claim cells print
(the error text, the verdict lines, the tables) is still what a fresh run prints. A claim cell is a
code cell tagged ``nbval-check-output``: nbval's own marker, so ``pytest --nbval-lax`` checks the
same cells on a reader's machine. Outputs are compared as nbval compares them (streams coalesced,
``data`` flattened by MIME type, each text passed through the shared sanitize file
``docs/nbval-sanitize.cfg``, which is also published next to the entry pages).

References live in ``tests/notebooks/claims/<entry>.json``, one per entry, keyed by
``<release>-<environment>`` and the claim cell's id: small, reviewed in diffs. No notebook runs twice
for this: the check reads the runs the notebook tests already made (``build/executed``).

    python -m ci.notebooks.claims refresh  # after an intended change: rewrite the references from build/
    python -m ci.notebooks.claims check    # compare build/'s runs with the references; exit 1 on a difference
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nbformat
from nbval.plugin import coalesce_streams, get_sanitize_patterns, transform_streams_for_comparison

from .. import ROOT
from .runner import BUILD, executed_notebook, notebook_path, recorded_runs

TAG = "nbval-check-output"  # nbval's marker: checked under --nbval-lax
SANITIZE = ROOT / "docs" / "nbval-sanitize.cfg"
REFERENCES = ROOT / "tests" / "notebooks" / "claims"
# What nbval leaves out of a comparison by default (IPyNbFile.skip_compare), plus stderr: a claim cell
# prints its claim to stdout; warnings and library chatter go to stderr and differ between machines.
SKIPPED = frozenset({"metadata", "traceback", "latex", "prompt_number", "output_type", "name", "execution_count",
                     "application/vnd.jupyter.widget-view+json", "stderr"})


class ClaimsError(Exception):
    """A reference that is missing or does not cover a notebook's claim cells."""


@dataclass(frozen=True)
class Mismatch:
    entry: str
    run: str  # "<release>-<environment>"
    cell: str  # "cell 7 (id 010bafff): first line of its source"
    reference: str
    found: str

    def __str__(self) -> str:
        diff = "\n".join(difflib.unified_diff(self.reference.splitlines(), self.found.splitlines(), "reference",
                                              "this run", lineterm=""))
        return f"{self.entry} on {self.run}, {self.cell}: the claim changed\n{diff}"


def sanitize_patterns(path: Path = SANITIZE) -> list[tuple[str, str]]:
    """The (regex, replacement) pairs of the sanitize file, read by nbval's own parser."""
    return get_sanitize_patterns(path.read_text())


def sanitize(text: str, patterns: list[tuple[str, str]]) -> str:
    """``text`` with every (regex, replacement) of ``patterns`` applied in order, as nbval does."""
    for regex, replacement in patterns:
        text = re.sub(regex, replacement, text)
    return text


def chatter(patterns: list[tuple[str, str]] | None = None) -> list[re.Pattern[str]]:
    """The sanitize file's whole-line rules (``(?m)^...(\\n|$)``, replaced by nothing): DeepSpeed's log
    lines, warnings, memory reports. Neither a claim nor a page shows them: the site drops the same lines
    from its page copies."""
    patterns = sanitize_patterns() if patterns is None else patterns
    return [re.compile(regex) for regex, replacement in patterns
            if regex.startswith("(?m)^") and regex.endswith("(\\n|$)") and not replacement]


def claim_cells(notebook: nbformat.NotebookNode) -> list[tuple[int, nbformat.NotebookNode]]:
    """(number, cell) of every claim cell; ``number`` counts code cells from 0, papermill's injected
    parameters cell left out, as nbval numbers the cells of the stored notebook."""
    code = [cell for cell in notebook.cells
            if cell.cell_type == "code" and "injected-parameters" not in cell.metadata.get("tags", [])]
    return [(number, cell) for number, cell in enumerate(code) if TAG in cell.metadata.get("tags", [])]


def _label(number: int, cell: nbformat.NotebookNode) -> str:
    first = next((line for line in cell.source.splitlines() if line.strip()), "")
    return f"cell {number} (id {cell.get('id', '?')}): {first[:60]}"


def shown(cell: nbformat.NotebookNode, patterns: list[tuple[str, str]]) -> dict[str, list[list[str]]]:
    """What nbval compares for one executed cell: {output key: [sanitized text, ...]}, each text as its
    lines (so that a reference's diff shows the line that changed)."""
    flat: dict[str, list[list[str]]] = {}
    for output in transform_streams_for_comparison(coalesce_streams([nbformat.from_dict(o) for o in cell.outputs])):
        for key, value in output.items():
            if key in SKIPPED:
                continue
            items = value.items() if key == "data" else [(key, value)]
            for sub, text in items:
                if sub in SKIPPED:
                    continue
                text = "".join(text) if isinstance(text, list) else str(text)
                flat.setdefault(sub, []).append(sanitize(text, patterns).splitlines(keepends=True))
    return flat


def claims(executed: Path, source: Path | None = None,
           patterns: list[tuple[str, str]] | None = None) -> dict[str, dict[str, Any]]:
    """{cell id: {"cell": label, "shown": :func:`shown`}} for every claim cell of an executed notebook.
    The claim cells are those tagged in ``source`` (the stored notebook; default: the executed copy,
    which carries the same tags), matched by cell id."""
    patterns = sanitize_patterns() if patterns is None else patterns
    notebook = nbformat.read(executed, as_version=4)
    tagged = [(number, cell.id) for number, cell in claim_cells(nbformat.read(source or executed, as_version=4))]
    by_id = {cell.get("id"): cell for cell in notebook.cells}
    found = {}
    for number, cell_id in tagged:
        if cell_id not in by_id:
            raise ClaimsError(f"{executed}: claim cell {cell_id} (cell {number}) is not in this run")
        found[cell_id] = {"cell": _label(number, by_id[cell_id]), "shown": shown(by_id[cell_id], patterns)}
    return found


def _text(shown_: dict[str, list[list[str]]]) -> str:
    return "\n".join(f"[{key}]\n" + "\n".join("".join(lines) for lines in texts) for key, texts in sorted(shown_.items()))


def compare(entry: str, run: str, found: dict[str, dict[str, Any]], reference: dict[str, dict[str, Any]]) -> list[Mismatch]:
    """Every claim cell whose output differs from its reference; a cell on one side only is a mismatch too."""
    mismatches = []
    for cell_id in sorted(found.keys() | reference.keys()):
        if cell_id not in reference:
            mismatches.append(Mismatch(entry, run, found[cell_id]["cell"], "(no reference: `python -m ci.notebooks.claims "
                                       "refresh` after reviewing the output)", _text(found[cell_id]["shown"])))
        elif cell_id not in found:
            mismatches.append(Mismatch(entry, run, reference[cell_id]["cell"], _text(reference[cell_id]["shown"]),
                                       "(no such claim cell in this run)"))
        elif found[cell_id]["shown"] != reference[cell_id]["shown"]:
            mismatches.append(Mismatch(entry, run, found[cell_id]["cell"], _text(reference[cell_id]["shown"]),
                                       _text(found[cell_id]["shown"])))
    return mismatches


def run_key(release: str, environment: str) -> str:
    return f"{release}-{environment}"


def reference_path(entry: str, root: Path = REFERENCES) -> Path:
    return root / f"{entry}.json"


def load_reference(entry: str, release: str, environment: str, root: Path = REFERENCES) -> dict[str, dict[str, Any]]:
    path = reference_path(entry, root)
    if not path.exists():
        raise ClaimsError(f"{entry}: no claims reference ({path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}); "
                          "run its notebook, review the output, then `python -m ci.notebooks.claims refresh`")
    runs = json.loads(path.read_text())
    key = run_key(release, environment)
    if key not in runs:
        raise ClaimsError(f"{entry}: its claims reference has no run {key} (it has {', '.join(sorted(runs)) or 'none'}); "
                          "`python -m ci.notebooks.claims refresh` after the notebook has run there")
    return runs[key]


def check(entry: str, release: str, environment: str, executed: Path, root: Path = REFERENCES) -> list[Mismatch]:
    """The claim cells of ``executed`` (one run of ``entry``) against the committed reference. Both sides
    go through the sanitize file, as nbval sanitizes the stored and the new output: a rule added since the
    reference was written applies to it too."""
    patterns = sanitize_patterns()
    found = claims(executed, notebook_path(entry), patterns)
    reference = resanitized(load_reference(entry, release, environment, root), patterns)
    return compare(entry, run_key(release, environment), found, reference)


def resanitized(reference: dict[str, dict[str, Any]], patterns: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """``reference`` (claim cells as :func:`claims` returns them) with ``patterns`` applied to its texts again."""
    return {cell_id: {**cell, "shown": {key: [sanitize("".join(lines), patterns).splitlines(keepends=True)
                                              for lines in texts]
                                        for key, texts in cell["shown"].items()}}
            for cell_id, cell in reference.items()}


def _passed_runs(build: Path) -> list[tuple[str, str, str, Path]]:
    """(entry, release, environment, executed notebook) of every passing run the runner recorded in ``build``."""
    return [(r.entry, r.release, r.environment, executed_notebook(r)) for r in recorded_runs(build) if r.passed]


def refresh(build: Path = BUILD, root: Path = REFERENCES, entries: list[str] | None = None) -> list[Path]:
    """Rewrite each entry's reference from ``build``'s passing runs (runs not in ``build`` are kept).
    ``entries``: only these entries' references (the others are not read or written)."""
    patterns = sanitize_patterns()
    written: dict[Path, dict[str, Any]] = {}
    for entry, release, environment, executed in _passed_runs(build):
        if entries is not None and entry not in entries:
            continue
        path = reference_path(entry, root)
        runs = written.setdefault(path, json.loads(path.read_text()) if path.exists() else {})
        runs[run_key(release, environment)] = claims(executed, notebook_path(entry), patterns)
    root.mkdir(parents=True, exist_ok=True)
    for path, runs in written.items():
        path.write_text(json.dumps(dict(sorted(runs.items())), indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    return sorted(written)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.notebooks.claims", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["refresh", "check"])
    parser.add_argument("--build", type=Path, default=BUILD)
    parser.add_argument("--entry", action="append", help="refresh only this entry's reference (repeatable)")
    args = parser.parse_args(argv)
    if args.command == "refresh":
        for path in refresh(args.build, entries=args.entry):
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    failed = 0
    for entry, release, environment, executed in _passed_runs(args.build):
        mismatches = check(entry, release, environment, executed)
        for mismatch in mismatches:
            print(mismatch, file=sys.stderr)
        failed += bool(mismatches)
    print(f"{failed} run(s) with a changed claim")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
