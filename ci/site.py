"""Generate the site's pages from the registry, the runner's records and the executed notebooks.

    python -m ci.site        # writes docs/generated/, then: mkdocs build --strict

Nothing here is hand-maintained: the status table, the component index and each entry's page
(its executed notebook with the entry's metadata on top) are rebuilt from ``fixes`` and
``build/``. A missing or failed run is an error, never a silently stale page.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import nbformat

import fixes
from fixes import card, measured
from fixes.fix import FixInfo
from fixes.record import PASSING, RunResult
from fixes.versions import parse

from . import ROOT
from . import releases as release_env
from .colab import colab_url
from .runner import BUILD

GENERATED = ROOT / "docs" / "generated"

# Output lines that are chatter, not findings: DeepSpeed's log lines, its op-compatibility probe's
# linker errors, Python warnings and the source line they quote. They are dropped from the page
# copy (the executed notebook in build/ keeps everything) so readers and the search index see the
# entry's own results.
NOISE = re.compile(r"^(\[\d{4}-\d\d-\d\d |\[rank\d+\]|/usr/bin/ld: |collect2: |.*Warning: |\s+return func\(|"
                   r"\s+warnings\.warn|\s*_?torch_pytree|Building ZeRO module|.*Triggered internally at )")


CARD_TAG = "entry-card"  # the notebook cell that shows the entry card (fixes.card.show)


def load_results(build: Path = BUILD) -> dict[tuple[str, str], RunResult]:
    results = {}
    for path in sorted((build / "results").glob("*/*.json")):
        result = RunResult.from_json(json.loads(path.read_text()))
        results[(result.entry, result.release)] = result
    return results


def cell_status(result: RunResult | None) -> str:
    """A run's verdict (:attr:`fixes.record.RunResult.verdict`), bold where it is a failure."""
    if result is None:
        return "–"
    return result.verdict if result.verdict in PASSING else f"**{result.verdict}**"


def clean_outputs(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop chatter lines (``NOISE``) from stream outputs, and outputs left empty."""
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                lines = [line for line in output["text"].splitlines(keepends=True) if not NOISE.match(line)]
                output["text"] = "".join(lines)
                if not output["text"].strip():
                    continue
            kept.append(output)
        cell["outputs"] = kept
    return notebook


MATRIX_MARKS = {"affected": "●", "not affected": "○", "inconsistent": "?", "could not run": "–"}
FIX_MARKS = {"fixed": "", "not fixed": "✗", "refused": "✗", "could not run": "✗"}


def coverage_summary() -> tuple[int, int]:
    """(affected pairs whose fix was measured *fixed*, affected pairs) over every entry."""
    sweeps = [fix.info.sweep for fix in fixes.all_fixes()]
    return sum(len(s.fixed) for s in sweeps), sum(len(s.affected) for s in sweeps)


def matrix_page() -> str:
    """Every entry × every swept release, from the sweep file."""
    data = measured.load()
    releases = data.releases
    lines = ["# Measured version matrix", "",
             f"Every entry's probe and behavioural check on every DeepSpeed release from {releases[0] if releases else '–'} "
             f"to {releases[-1] if releases else '–'} (`python -m ci.sweep`; torch {data.torch}, Python {data.python}"
             + (f"; last full sweep {data.full_run['at']}, {data.full_run['wall_s'] / 60:.0f} min on 2 cores"
                if data.full_run else "")
             + "). ● affected · ○ not affected · ? probe and behaviour disagree · – could not run. "
             "●✗: affected, and the entry's fix does not fix that release (refused, not fixed or could not run; "
             "the entry page says why).", "",
             "Fix coverage: the fix fixes {0} of the {1} affected (entry, release) pairs "
             "(applied, then the behavioural check run again).".format(*coverage_summary()), "",
             "| Entry | Affected | " + " | ".join(r.removeprefix("0.") for r in releases) + " |",
             "|---|---|" + "---|" * len(releases)]
    for fix in fixes.all_fixes():
        sweep = fix.info.sweep
        marks = [MATRIX_MARKS[sweep.get(r).status] + FIX_MARKS.get(sweep.get(r).fix or "fixed", "")
                 if sweep.get(r) else " " for r in releases]
        lines.append(f"| [{fix.id}](entries/{fix.id}.ipynb) | {sweep.range_text} | " + " | ".join(marks) + " |")
    reasons = sorted({(o.release, o.reason) for fix in fixes.all_fixes() for o in fix.info.sweep.observations.values()
                      if o.status == "could not run"}, key=lambda pair: parse(pair[0]))
    if reasons:
        lines += ["", "Could not run:", ""] + [f"- {release}: {reason}" for release, reason in reasons]
    return "\n".join(lines) + "\n"


def header_markdown(info: FixInfo) -> str:
    badge = (f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(info.id)}) "
             f"(installs DeepSpeed {info.reproduce_release} and `fixes`, uses the GPU when there is one)")
    return (f"# {info.title}\n\n{badge}\n\n{card.card(info, matrix_link='../matrix.md')}\n"
            f"The rest of this page is the entry's notebook as CI executed it on DeepSpeed {info.reproduce_release}.\n")


def entry_page(info: FixInfo, runs: dict[str, RunResult], out_dir: Path) -> Path:
    run = runs.get(info.reproduce_release)
    if run is None or not run.passed:
        raise RuntimeError(f"{info.id}: no passing run on {info.reproduce_release} in build/ "
                           f"(run `python -m ci.runner` first)")
    notebook = clean_outputs(nbformat.read(run.executed, as_version=4))
    # The notebook's title and its card cell are the header's first lines: replaced by it, not repeated.
    if notebook.cells and notebook.cells[0].cell_type == "markdown":
        notebook.cells.pop(0)
    notebook.cells = [c for c in notebook.cells if CARD_TAG not in c.get("metadata", {}).get("tags", [])]
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell(header_markdown(info)))
    path = out_dir / f"{info.id}.ipynb"
    nbformat.write(notebook, path)
    return path


def status_table(results: dict[tuple[str, str], RunResult]) -> str:
    """One row per entry: what was measured, and one column per release the runner ran on."""
    run_releases = [r for r in release_env.load().releases if any(release == r for _, release in results)]
    lines = ["# Status of every entry", "",
             "Generated from the `fixes` registry, the release sweep and the runner's records. *Affected (measured)* "
             "is the range the sweep measured ([matrix](matrix.md)); ⚠ marks a range that differs from upstream's "
             "statement (the entry page says how). The last columns are this build's notebook runs.", "",
             "| Entry | Symptom · components | Affected (measured) | First fixed (measured) | "
             + " | ".join(f"{r} run" for r in run_releases) + " |",
             "|---|---|---|---|" + "---|" * len(run_releases)]
    for fix in fixes.all_fixes():
        info = fix.info
        cells = [cell_status(results.get((info.id, release))) for release in run_releases]
        lines.append(f"| [{info.title}](entries/{info.id}.ipynb) | {info.symptom} · {', '.join(info.components)} | "
                     f"{info.sweep.range_text} | {info.sweep.first_fixed or 'open'}"
                     + (" ⚠" if info.upstream_disagreement else "") + " | " + " | ".join(cells) + " |")
    lines += ["", "*reproduced → fixed*: the bug showed and the fix verified against plain PyTorch within the dtype's "
              "tolerance. *not affected*: nothing to fix, and the same checks passed."]
    return "\n".join(lines) + "\n"


def components_page() -> str:
    by_component: dict[str, list[FixInfo]] = {}
    for fix in fixes.all_fixes():
        for component in fix.info.components:
            by_component.setdefault(component, []).append(fix.info)
    lines = ["# Entries by component", ""]
    for component in sorted(by_component):
        lines += [f"## {component}", ""]
        lines += [f"- [{info.title}](entries/{info.id}.ipynb) — {info.symptom}" for info in by_component[component]]
        lines.append("")
    return "\n".join(lines)


def generate(build: Path = BUILD, out: Path = GENERATED) -> None:
    results = load_results(build)
    shutil.rmtree(out, ignore_errors=True)
    (out / "entries").mkdir(parents=True)
    for fix in fixes.all_fixes():
        runs = {release: record for (entry, release), record in results.items() if entry == fix.id}
        entry_page(fix.info, runs, out / "entries")
    (out / "status.md").write_text(status_table(results))
    (out / "components.md").write_text(components_page())
    (out / "matrix.md").write_text(matrix_page())
    print(f"site pages generated in {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.site", description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=BUILD)
    args = parser.parse_args(argv)
    try:
        generate(args.build)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
