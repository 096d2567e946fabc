"""Generate the site's pages from the registry, the runner's records and the executed notebooks.

    python -m ci.site            # writes docs/generated/, then: mkdocs build --strict
    python -m ci.site --mkdocs   # the same, with the entry pages converted on every core, and mkdocs build --strict
                                 # in this process (ci/build.sh)

Nothing here is hand-maintained: the status table, the component index and each entry's page
(its executed notebook with the entry's metadata on top) are rebuilt from ``fixes`` and
``build/``. A missing or failed run is an error, never a silently stale page.

Package ``ci.site``: publishing. The generated pages (here) and the MkDocs hook that ``mkdocs.yml`` names
(``mkdocs_hooks.py``, loaded by MkDocs from its path; it imports nothing of the project).
May import: ``ci.triage``, ``ci.sweep``, ``ci.notebooks``, ``ci.releases``, ``ci.processes`` and ``fixes``.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

import nbformat

import fixes
from fixes import card, measured
from fixes import search as search_module
from fixes.fix import FixInfo
from fixes.record import PASSING, RunResult
from fixes.versions import parse

from .. import ROOT
from .. import releases as release_env
from ..notebooks import claims
from .. import triage as triage_module
from ..notebooks.colab import colab_url
from ..notebooks.runner import BUILD, notebook_path, recorded_runs
from . import checked, notebook_pages

GENERATED = ROOT / "docs" / "generated"

# Output lines that are chatter, not findings (DeepSpeed's log lines, its op probe's linker errors, Python
# warnings, memory reports): the sanitize file's whole-line rules, the ones a claim check drops too. They
# are dropped from the page copy (the executed notebook in build/ keeps everything) so readers and the
# search index see the entry's own results.
CHATTER = claims.chatter()


CARD_TAG = "entry-card"  # the notebook cell that shows the entry card (fixes.card.show)
# A notebook's link to another entry's notebook ("](other-entry.ipynb)", right on GitHub and Colab): on the
# site, that entry's page.
SIBLING_LINK = re.compile(r"\]\(([a-z0-9][a-z0-9-]*)\.ipynb(#[^)]*)?\)")


def _md(text: str) -> str:
    """``text`` as Markdown shows it literally: a title naming ``ZeROOrderedDict.__reduce__`` is not bold "reduce"."""
    return re.sub(r"([\\`*_\[\]])", r"\\\1", text)


def load_results(build: Path = BUILD, environment: str | None = "cpu") -> dict[tuple[str, str], RunResult]:
    """{(entry, release): run} of one environment's runs in ``build`` (``None``: every environment's,
    keyed (entry, "release (environment)") for the others)."""
    results = {}
    for result in recorded_runs(build):
        if environment is None and result.environment != "cpu":
            results[(result.entry, f"{result.release} ({result.environment})")] = result
        elif result.environment == environment or (environment is None and result.environment == "cpu"):
            results[(result.entry, result.release)] = result
    return results


def cell_status(result: RunResult | None) -> str:
    """A run's verdict (:attr:`fixes.record.RunResult.verdict`), bold where it is a failure."""
    if result is None:
        return "–"
    return result.verdict if result.verdict in PASSING else f"**{result.verdict}**"


def _machine_paths() -> list[tuple[re.Pattern[str], str]]:
    root = re.escape(str(ROOT))
    temp = re.escape(tempfile.gettempdir().rstrip("/"))
    segment = r"""[^\s'"/:]+"""
    return [
        (re.compile(rf"{root}/\.deepspeed/{segment}/"), "site-packages/"),  # a release installed side by side
        (re.compile(rf"(?:/{segment})+/lib/python\d+\.\d+/(?:site|dist)-packages/"), "site-packages/"),
        (re.compile(rf"(?:/{segment})+/lib/(python\d+\.\d+)/"), r"\1/"),  # the standard library
        (re.compile(rf"{root}/"), ""),  # this checkout's files, relative to it
        (re.compile(rf"{temp}/{segment}/"), ""),  # a notebook's temporary directory
    ]


MACHINE_PATHS = _machine_paths()


def public_paths(text: str) -> str:
    """``text`` with this machine's paths as a reader's own machine would show them: installed packages
    under ``site-packages/``, the standard library under ``pythonX.Y/``, the checkout's files relative to
    it, a temporary directory's files relative to it. No machine path reaches a published page."""
    for pattern, replacement in MACHINE_PATHS:
        text = pattern.sub(replacement, text)
    return text


def _public(value):
    if isinstance(value, str):
        return public_paths(value)
    if isinstance(value, list):
        return [_public(item) for item in value]
    if isinstance(value, dict):
        return type(value)({key: _public(item) for key, item in value.items()})
    return value


MEMORY_REPORT = re.compile(r"MA [\d.]+ GB ")  # DeepSpeed's see_memory_usage: a heading line, then this one


def _is_chatter(line: str) -> bool:
    return any(pattern.sub("", line) == "" for pattern in CHATTER)


def drop_chatter(text: str) -> str:
    """``text`` without its chatter lines. Lines are split as Jupyter shows them, so each ``\r`` redraw of a
    progress bar is a line of its own; a memory report's heading line (the line before ``MA … GB``) goes
    with the report."""
    lines = text.splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines):
        following = lines[number + 1] if number + 1 < len(lines) else ""
        if _is_chatter(line) or MEMORY_REPORT.match(following):
            continue
        kept.append(line)
    return "".join(kept)


def clean_outputs(notebook: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Drop chatter lines (``CHATTER``) from stream outputs, and outputs left empty; write this machine's
    paths as :func:`public_paths` does, in every output and the notebook's metadata."""
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                output["text"] = drop_chatter(output["text"])
                if not output["text"].strip():
                    continue
            for key in ("text", "data", "evalue", "traceback"):
                if key in output:
                    output[key] = _public(output[key])
            kept.append(output)
        cell["outputs"] = kept
    notebook.metadata = _public(notebook.metadata)  # papermill's record of the input path, among others
    return notebook


MATRIX_MARKS = {"affected": "●", "not affected": "○", "inconsistent": "?", "could not run": "–"}
UNFIXED_MARK = "✖"  # affected, and the fix was measured not fixing it there


def mark(observation: measured.Observation | None) -> str:
    if observation is None:
        return " "
    if observation.status == "affected" and observation.fix not in (None, "fixed"):
        return UNFIXED_MARK
    return MATRIX_MARKS[observation.status]


def by_minor(releases: list[str]) -> dict[str, list[str]]:
    """Releases grouped by minor series, in order: {"0.16": ["0.16.0", …], …}."""
    groups: dict[str, list[str]] = {}
    for release in releases:
        groups.setdefault(release.rsplit(".", 1)[0], []).append(release)
    return groups


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
             + "). One column per minor series, one mark per patch release in order: ● affected (the fix fixes "
             "it) · ✖ affected, and the entry's fix does not fix that release (refused, not fixed or could not run; "
             "the entry page says why) · ○ not affected · ? probe and behaviour disagree · – could not run. "
             "[A page per release](releases/index.md) lists its known bugs.", "",
             "Fix coverage: the fix fixes {0} of the {1} affected (entry, release) pairs "
             "(applied, then the behavioural check run again).".format(*coverage_summary()), "",
             "| Entry | Affected | " + " | ".join(f"{minor} (.{series[0].rsplit('.', 1)[1]} – .{series[-1].rsplit('.', 1)[1]})"
                                                    for minor, series in by_minor(releases).items()) + " |",
             "|---|---|" + "---|" * len(by_minor(releases))]
    for fix in fixes.all_fixes():
        sweep = fix.info.sweep
        cells = ["`" + "".join(mark(sweep.get(r)) for r in series) + "`" for series in by_minor(releases).values()]
        kind = " (behaviour change: ● = has it)" if fix.info.is_behaviour_change else ""
        lines.append(f"| [{fix.id}](entries/{fix.id}.ipynb){kind} | {sweep.range_text} | " + " | ".join(cells) + " |")
    for name, other in sorted(data.environments.items()):
        # its own releases too: an environment may measure releases older than the project's (torch-2.3: 0.14.1 -)
        columns = by_minor(sorted(set(releases) | set(other.releases), key=parse))
        lines += ["", f"Measured in environment {name} (torch {other.torch}, Python {other.python}; `python -m ci.sweep "
                  f"--env {name}`):", "", "| Entry | Affected | " + " | ".join(
                      f"{minor} (.{series[0].rsplit('.', 1)[1]} – .{series[-1].rsplit('.', 1)[1]})"
                      for minor, series in columns.items()) + " |",
                  "|---|---|" + "---|" * len(columns)]
        for entry_id, sweep in sorted(other.results.items()):
            cells = ["`" + "".join(mark(sweep.get(r)) for r in series) + "`" for series in columns.values()]
            lines.append(f"| [{entry_id}](entries/{entry_id}.ipynb) | {sweep.range_text} | " + " | ".join(cells) + " |")
    reasons = sorted({(o.release, o.reason) for fix in fixes.all_fixes() for o in fix.info.sweep.observations.values()
                      if o.status == "could not run"}, key=lambda pair: parse(pair[0]))
    if reasons:
        lines += ["", "Could not run:", ""] + [f"- {release}: {reason}" for release, reason in reasons]
    return "\n".join(lines) + "\n"


def header_markdown(info: FixInfo) -> str:
    badge = (f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab_url(info.id)}) "
             f"(installs DeepSpeed {info.reproduce_release} and `fixes`, uses the GPU when there is one)")
    # Links as the page's URL needs them (generated/entries/<id>/): mkdocs rewrites no links in a notebook page.
    return (f"# {_md(info.title)}\n\n{badge}\n\n{card.card(info, matrix_link='../../matrix/')}\n"
            f"The rest of this page is the entry's notebook as CI executed it on DeepSpeed {info.reproduce_release}.\n\n"
            + recheck_markdown(info))


def recheck_markdown(info: FixInfo) -> str:
    """How a reader re-checks this page's claims on their own machine, with nbval. Raw HTML kept out of the
    search index (``data-search-exclude``): the same words on every entry page would only crowd the results;
    the "Re-check an entry" page is what a search for them should find."""
    checked = len(claims.claim_cells(nbformat.read(notebook_path(info.id), as_version=4)))
    return (f'<div data-search-exclude><p><strong>Re-check it on your machine.</strong> {checked} cells of this notebook '
            "carry nbval's <code>nbval-check-output</code> tag: their outputs below are the entry's claims. In an "
            f"environment with DeepSpeed {info.reproduce_release} and the <code>fixes</code> package, download "
            f'<a href="{info.id}.ipynb">this notebook</a> and the <a href="../../../nbval-sanitize.cfg">sanitize file</a>, '
            "then run</p>\n"
            f"<pre><code>pip install nbval\npytest --nbval-lax --nbval-sanitize-with nbval-sanitize.cfg {info.id}.ipynb"
            "</code></pre>\n<p>nbval runs every cell and compares the tagged ones with what this page shows. A "
            "difference means your environment differs from the one the Fixbook measured: see "
            '<a href="../../../recheck/">re-checking an entry</a>.</p></div>\n')


def entry_page(info: FixInfo, runs: dict[str, RunResult], out_dir: Path) -> Path:
    run = runs.get(info.reproduce_release)
    if run is None or not run.passed:
        raise RuntimeError(f"{info.id}: no passing run on {info.reproduce_release} in build/ "
                           f"(run `python -m ci.notebooks.runner` first)")
    notebook = clean_outputs(nbformat.read(run.executed, as_version=4))
    # The notebook's title and its card cell are the header's first lines: replaced by it, not repeated.
    if notebook.cells and notebook.cells[0].cell_type == "markdown":
        notebook.cells.pop(0)
    # Dropped from the page: the card cell (the header is the card) and papermill's injected
    # parameters (they hold this machine's path to the results file).
    notebook.cells = [c for c in notebook.cells
                      if not {CARD_TAG, "injected-parameters"} & set(c.get("metadata", {}).get("tags", []))]
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            cell.source = SIBLING_LINK.sub(lambda m: f"](../{m.group(1)}/{m.group(2) or ''})" if m.group(1) in
                                           fixes.available() else m.group(0), cell.source)
    # A fixed id (not a random one): the same runs give the same page, byte for byte, which mkdocs-jupyter's cache
    # (keyed by the notebook's bytes) finds again.
    notebook.cells.insert(0, nbformat.v4.new_markdown_cell(header_markdown(info), id="fixbook-entry-header"))
    path = out_dir / f"{info.id}.ipynb"
    nbformat.write(notebook, path)
    return path


def status_table(results: dict[tuple[str, str], RunResult]) -> str:
    """One row per entry: what was measured, and one column per release the runner ran on; runs in
    other environments (ci/environments.toml) get a column each, "<environment> run" on the reproduce release."""
    run_releases = [r for r in release_env.load().releases if any(release == r for _, release in results)]
    others = sorted({release.split(" (")[1][:-1] for _, release in results if " (" in release})
    runs = [f"{r} run" for r in run_releases] + [f"{env} run" for env in others]

    def row(info: FixInfo, label: str, open_: str) -> str:
        cells = [cell_status(results.get((info.id, release))) for release in run_releases]
        cells += [cell_status(results.get((info.id, f"{info.reproduce_release} ({env})"))) for env in others]
        return (f"| [{_md(info.title)}](entries/{info.id}.ipynb) | {label} · {', '.join(info.components)} | "
                f"{info.sweep.range_text} | {info.sweep.first_fixed or open_}"
                + (" ⚠" if info.upstream_disagreement else "") + " | " + " | ".join(cells) + " |")

    bugs = [fix.info for fix in fixes.all_fixes() if not fix.info.is_behaviour_change]
    changes = [fix.info for fix in fixes.all_fixes() if fix.info.is_behaviour_change]
    lines = ["# Status of every entry", "",
             "Generated from the `fixes` registry, the release sweep and the runner's records. *Affected (measured)* "
             "is the range the sweep measured ([matrix](matrix.md)); ⚠ marks a range that differs from upstream's "
             "statement (the entry page says how). The last columns are this build's notebook runs."
             + (" Behaviour changes, which are not bugs, have [a table of their own](#behaviour-changes)." if changes
                else ""), "",
             "## Bugs", "",
             "| Entry | Symptom · components | Affected (measured) | First fixed (measured) | " + " | ".join(runs) + " |",
             "|---|---|---|---|" + "---|" * len(runs)]
    lines += [row(info, info.symptom, "open") for info in bugs]
    lines += ["", "*reproduced → fixed*: the bug showed and the fix verified against plain PyTorch within the dtype's "
              "tolerance. *not affected*: nothing to fix, and the same checks passed."]
    if changes:
        lines += ["", "## Behaviour changes", "",
                  "Not bugs: intended upstream changes (a new default) that silently change results of configs "
                  "relying on the old behaviour. *Has it*: the releases measured with the new behaviour. The fix "
                  "pins the old one; `fixes.apply()` with no ids leaves it alone.", "",
                  "| Entry | Kind · components | Has it (measured) | Old behaviour back (measured) | "
                  + " | ".join(runs) + " |",
                  "|---|---|---|---|" + "---|" * len(runs)]
        lines += [row(info, "behaviour change", "no") for info in changes]
    return "\n".join(lines) + "\n"


def components_page() -> str:
    by_component: dict[str, list[FixInfo]] = {}
    for fix in fixes.all_fixes():
        for component in fix.info.components:
            by_component.setdefault(component, []).append(fix.info)
    lines = ["# Entries by component", ""]
    for component in sorted(by_component):
        lines += [f"## {component}", ""]
        lines += [f"- [{_md(info.title)}](entries/{info.id}.ipynb) — {info.label}" for info in by_component[component]]
        lines.append("")
    return "\n".join(lines)


def known_bugs(release: str) -> list[FixInfo]:
    """Bugs measured affected on ``release`` (from the sweep); behaviour changes are not bugs
    (:func:`behaviour_changes`)."""
    return [fix.info for fix in fixes.all_fixes()
            if fix.info.expected_affected(release) and not fix.info.is_behaviour_change]


def behaviour_changes(release: str) -> list[FixInfo]:
    """Behaviour changes (``FixInfo.kind``) measured present on ``release`` (from the sweep)."""
    return [fix.info for fix in fixes.all_fixes() if fix.info.expected_affected(release) and fix.info.is_behaviour_change]


def safer_releases(release: str, components: set[str], releases: list[str]) -> list[tuple[str, int]]:
    """The nearest release before and after ``release`` with fewer known bugs in ``components``
    (measured), with that count; none where no release has fewer."""
    def count(r: str) -> int:
        return sum(1 for info in known_bugs(r) if components & set(info.components))

    here, index = count(release), releases.index(release)
    found = []
    for step in (-1, 1):
        i = index + step
        while 0 <= i < len(releases):
            if count(releases[i]) < here:
                found.append((releases[i], count(releases[i])))
                break
            i += step
    return found


# Long generated lists stay out of the site's search index (their entries' own pages are in it).
NOT_INDEXED = "---\nsearch:\n  exclude: true\n---\n\n"


def behaviour_changes_section(release: str) -> list[str]:
    """A release page's list of the behaviour changes measured on it (empty where none)."""
    changes = behaviour_changes(release)
    if not changes:
        return []
    lines = ["", "## Behaviour changes", "",
             "Not bugs: intended upstream changes that alter the results of configs relying on the old behaviour. "
             "`fixes.apply()` leaves them alone; naming one pins the old behaviour.", "",
             "| Entry | Components | Pin the old behaviour |", "|---|---|---|"]
    lines += [f"| [{_md(info.title)}](../entries/{info.id}.ipynb) | {', '.join(info.components)} | `{info.apply_call}` |"
              for info in changes]
    return lines


def release_page(release: str, releases: list[str]) -> str:
    bugs = known_bugs(release)
    lines = [f"{NOT_INDEXED}# DeepSpeed {release}: {len(bugs)} known bug{'s' if len(bugs) != 1 else ''} here", "",
             f"Measured by the release sweep ([matrix](../matrix.md)) on DeepSpeed {release}: every entry's probe of "
             "the installed code and its behavioural check agree that the bug is there.", ""]
    if not bugs:
        lines.append("No entry of the Fixbook is measured affected on this release.")
        return "\n".join(lines + behaviour_changes_section(release)) + "\n"
    lines += ["| Entry | Symptom | The jobs it hits | The fix on this release |", "|---|---|---|---|"]
    for info in bugs:
        observation = info.sweep.get(release)
        fix = {"fixed": "fixes it (measured)", None: "not measured"}.get(
            observation.fix if observation else None, f"**{observation.fix if observation else ''}**: "
            f"{(observation.fix_reason if observation else '').split(': its fingerprint is')[0]}")
        trigger = fixes.get(info.id).trigger
        lines.append(f"| [{_md(info.title)}](../entries/{info.id}.ipynb) | {info.symptom} | "
                     f"{trigger.text() if trigger else 'not stated'} | {fix} |")
    fixable = [info for info in bugs if (info.sweep.get(release) and info.sweep.get(release).fix == "fixed")]
    lines += ["", f"One call applies every fix that works here ({len(fixable)} of {len(bugs)}; it skips the others "
              "and says why):", "", "```python", "import fixes", "fixes.apply()", "```", "",
              "Which of them your job hits depends on its configuration: `fixbook doctor --config ds_config.json` "
              "(with `--world-size` and `--uses`), or `fixes.check(engine)` after `deepspeed.initialize`.", ""]
    components = {c for info in bugs for c in info.components}
    safer = safer_releases(release, components, releases)
    if safer:
        lines += ["Nearest releases with fewer known bugs in the same components (" + ", ".join(sorted(components))
                  + "): " + ", ".join(f"[{r}]({r}.md) ({n})" for r, n in safer)
                  + ". A count of known bugs, not advice: other changes between releases are not measured here."]
    return "\n".join(lines + behaviour_changes_section(release)) + "\n"


def releases_index(releases: list[str]) -> str:
    lines = ["# Known bugs per DeepSpeed release", "",
             "From the release sweep ([matrix](../matrix.md)). Your release: `fixbook doctor` probes it and links its page.",
             "", "| Release | Known bugs | Entries | Behaviour changes (not bugs) |", "|---|---|---|---|"]
    for release in reversed(releases):
        bugs = known_bugs(release)
        changes = ", ".join(info.id for info in behaviour_changes(release)) or "–"
        lines.append(f"| [{release}]({release}.md) | {len(bugs)} | {', '.join(info.id for info in bugs) or '–'} | {changes} |")
    return "\n".join(lines) + "\n"


def coverage_counts() -> dict:
    """The counts the Coverage page shows, from fixes/data/upstream_fixes.json and the registry."""
    rows = json.loads(search_module.UPSTREAM_FIXES.read_text())["rows"]
    visible = [r for r in rows if r["user_visible"]]
    backlog = [r for r in rows if "triage" in r]
    triage: dict[str, int] = {}
    for row in backlog:
        triage[row["triage"]["status"]] = triage.get(row["triage"]["status"], 0) + 1
    by_component: dict[str, list[int]] = {}  # component: [census user-visible, backlog, proven entries]
    for row in visible:
        by_component.setdefault(row["component"], [0, 0, 0])[0] += 1
    for row in backlog:
        by_component.setdefault(row["component"], [0, 0, 0])[1] += 1
    for row in backlog:
        if row["triage"]["status"] == "entry":
            by_component[row["component"]][2] += 1
    by_state: dict[str, dict[str, int]] = {}  # component: {triage status: rows}
    for row in backlog:
        states = by_state.setdefault(row["component"], {})
        states[row["triage"]["status"]] = states.get(row["triage"]["status"], 0) + 1
    first = sorted({r["census_first_release"][1:] for r in rows if r["census_first_release"].startswith("v")},
                   key=parse)
    return {"rows": len(rows), "user_visible": len(visible), "backlog": len(backlog), "triage": triage,
            "first_released": first[0] if first else None,
            "triage_by_component": dict(sorted(by_state.items(), key=lambda kv: (-sum(kv[1].values()), kv[0]))),
            "checked": sum(1 for r in rows if r["check"]["status"] == "measured"),
            "entries": len(fixes.available()), "by_component": dict(sorted(by_component.items()))}


def older_releases_section() -> list[str]:
    """The Coverage page's account of the releases older than the sweep's oldest (``[[older]]`` in
    ``ci/releases.toml``): which environment measures them, or the commands tried and what they answered."""
    data = measured.load()
    lines = ["", "## Releases older than the sweep's oldest", "",
             f"The release sweep measures every release from {data.releases[0]} on with the project's torch "
             f"{data.torch}. The older ones:", ""]
    for item in release_env.older():
        if item.environment:
            part = data.environment(item.environment)
            rows = [o for found in part.results.values() for o in found.observations.values()]
            lines.append(f"- **{item.span}**: {item.why}. Measured in environment {item.environment} (torch "
                         f"{part.torch or '–'}, Python {part.python or '–'}; `python -m ci.sweep --env {item.environment}`): "
                         f"{len(part.results)} entries, {len(rows)} rows on {', '.join(part.releases) or 'no release yet'}; "
                         "kept apart from the ranges, which come from the project's environment.")
        else:
            lines.append(f"- **{item.span}**: {item.why}. Not measured: {item.cannot}. Tried: "
                         + "; ".join(f"`{command}` answered {answer}" for command, answer in zip(item.tried, item.answer))
                         + ".")
    return lines


def shown_by(outcome: triage_module.Outcome) -> str:
    """The Next entries table's last column: what showed the bug, on which releases."""
    if outcome.state == triage_module.GRID_REPRODUCED:
        cells = ", ".join(outcome.grid.get("carrying", [])[:2])
        return f"no usable upstream test; grid cell {cells} differs on {outcome.before}, agrees on {outcome.after}"
    return f"{outcome.before} fails, {outcome.after} passes"


def coverage_page() -> str:
    counts = coverage_counts()
    rows = json.loads(search_module.UPSTREAM_FIXES.read_text())["rows"]
    lines = [f"{NOT_INDEXED}# Coverage: the Fixbook against every upstream fix", "",
             f"The census of DeepSpeed's bug-fix commits first released in {counts['first_released']} or later holds "
             f"<span id=\"census-rows\">{counts['rows']}</span> fixes, <span id=\"census-visible\">{counts['user_visible']}</span> of them visible to a training user; "
             f"<span id=\"census-backlog\">{counts['backlog']}</span> of those look reproducible on CPU (the backlog). "
             f"The Fixbook proves <span id=\"census-entries\">{counts['entries']}</span> entries. The census is a quick "
             "read of each commit, not a measurement: "
             f"{counts['checked']} rows are checked by an entry's sweep; the rest say why they are not.", "",
             "## Backlog triage", "", "| Status | Rows |", "|---|---|"]
    lines += [f"| {status} | <span class=\"triage-count\" data-status=\"{status}\">{n}</span> |"
              for status, n in sorted(counts["triage"].items())]
    lines += ["", "Each backlog row is measured with upstream's own test from the fix PR (`python -m ci.triage`): the "
              "test functions the fix commit added or changed, on CPU, against the last release without the fix and "
              "the first with it. *Reproduced by upstream's test* means it fails before and passes after: the bug "
              "shows on CPU, and the row is a candidate entry. A row whose fix ships no test, or whose test uses what "
              "the fix adds and so cannot run without it, is decided by the differential sweep's grid "
              "(`python -m ci.triage.grid`): every cell runs once more on the last release without the fix with a "
              "call trace, and the cells that ran a function the fix changed are judged by their recorded verdicts "
              "on both releases. *Reproduced by the differential sweep*: one differs or crashes before and agrees "
              "after, and neither another entry's bug nor another fix of the same release can explain it. *Not "
              "detected by the grid*: no such cell (the row names the cells that ran the changed code, or says none "
              "does). Each row below carries the command that repeats it.",
              "", "## Backlog triage by component", ""]
    present = {s for per in counts["triage_by_component"].values() for s in per}
    order = ("entry", *triage_module.STATES, "planned", "does not reproduce here", "duplicate of", "not tried")
    states = [s for s in order if s in present] + sorted(present - set(order))  # a status decided by hand too
    lines += ["| Component | " + " | ".join(states) + " |", "|---|" + "---|" * len(states)]
    lines += [f"| {component} | " + " | ".join(
        f"<span class=\"triage-cell\" data-component=\"{component}\" data-status=\"{state}\">{per.get(state, 0)}</span>"
        for state in states) + " |" for component, per in counts["triage_by_component"].items()]
    lines += ["", "## Next entries", "",
              "The rows upstream's own test reproduces on CPU and no entry proves yet, ranked: silent wrong results "
              "and data loss first, then hangs, then crashes; ZeRO-3 and checkpoints first within each "
              "(`python -m ci.triage --next`).", ""]
    ranked = triage_module.ranked()
    if ranked:
        lines += ["| # | PR | Component | Symptom | Subject | Shown by |", "|---|---|---|---|---|---|"]
        for number, (row, outcome) in enumerate(ranked, 1):
            subject = row.subject.replace("|", "\\|")
            lines.append(f"| {number} | [#{row.pr}](https://github.com/deepspeedai/DeepSpeed/pull/{row.pr}) | "
                         f"{row.component} | {row.symptom} | {subject} | {shown_by(outcome)} |")
    else:
        lines.append("None yet.")
    lines += older_releases_section()
    lines += ["", "## By component", "", "| Component | User-visible upstream fixes | Backlog (CPU) | Proven here |",
              "|---|---|---|---|"]
    lines += [f"| {c} | {v} | {b} | {e} |" for c, (v, b, e) in counts["by_component"].items()]
    lines += ["", "## Known upstream fixes without an entry", "",
              "`fixbook search` lists these below the proven entries when an error names them; `fixbook doctor` counts "
              "those the installed release lacks. No proof and no fix module: upstream's remedy is its fixed release.", "",
              "| PR | First fixed (census) | Component | Symptom | Subject | Triage | Checked |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        if not row["user_visible"] or row["check"]["status"] == "measured" or row.get("triage", {}).get("status") == "entry":
            continue  # proven rows are the entries themselves
        triage = row.get("triage", {})
        status = triage.get("status", "–") + (f": [{triage['entry']}](entries/{triage['entry']}.ipynb)"
                                              if triage.get("entry") else "")
        if row.get("upstream_test"):
            status = search_module.upstream_test_line(row).replace("|", "\\|")
        pr = f"[#{row['pr']}](https://github.com/deepspeedai/DeepSpeed/pull/{row['pr']})" if row["pr"] else row["sha"]
        subject = row["subject"].replace("|", "\\|")
        lines.append(f"| {pr} | {row['first_release'] or 'after 0.19.5'} | {row['component']} | {row['symptom']} | "
                     f"{subject} | {status} | {row['check']['status']} |")
    return "\n".join(lines) + "\n"


BISECT_SCRIPT = ROOT / "tests" / "fixes" / "data" / "bisect_zero2_grad_accum.py"
BISECT_EXAMPLE = ROOT / "docs" / "bisect-example.json"  # written by the command shown on the page


def bisect_page() -> str:
    """``fixbook bisect`` with a worked example: the script, and the recorded output of the run."""
    from fixes.bisect import Bisection, Run, table

    lines = ["# Bisect your own reproduction", "",
             "`fixbook bisect SCRIPT` runs your reproduction once per DeepSpeed release (each installed once into a "
             "cache, `--no-deps`, nothing compiled) and finds where its answer changes, with far fewer runs than "
             "trying every release. The script exits 0 where the bug is absent and 1 where it is present; a crash "
             "or a timeout is *could not run*, never *present*. `--marker TEXT` reads the output instead. Then it "
             "names the Fixbook entries whose measured range agrees with every run.", "",
             "## A worked example", "", "A user's script for ZeRO-2 gradient accumulation, plain DeepSpeed and torch:",
             "", "```python", BISECT_SCRIPT.read_text().rstrip(), "```", ""]
    if BISECT_EXAMPLE.exists():
        data = json.loads(BISECT_EXAMPLE.read_text())
        result = Bisection(data["releases"], {r["release"]: Run(**r) for r in data["runs"]}, data["interrupted"])
        ran = [r for r in data["runs"] if r["detail"] != "given"]
        lines += ["Its run over the releases installed here "
                  "(`fixbook bisect bisect_zero2_grad_accum.py --offline --cache .deepspeed --json docs/bisect-example.json`):",
                  "", "```", table(result), result.summary, "```", "",
                  f"{len(ran)} runs for {len(data['releases'])} releases, {sum(r['seconds'] for r in ran) / 60:.1f} min "
                  "of runs on 2 CPU cores (each run starts Python, imports DeepSpeed and trains two steps). "
                  f"The recovered range is the one the release sweep measured for "
                  "[zero2-grad-accum-last-microbatch](entries/zero2-grad-accum-last-microbatch.ipynb), which `fixbook "
                  "bisect` names at the end of its output.", ""]
    return "\n".join(lines) + "\n"


def generate(build: Path = BUILD, out: Path = GENERATED, entries_written: Callable[[], object] | None = None) -> None:
    """Write every generated page into ``out`` (emptied first), the entry pages first; ``entries_written`` is called
    once those are written, before the others (``--mkdocs`` starts converting them there)."""
    results = load_results(build)
    shutil.rmtree(out, ignore_errors=True)
    (out / "entries").mkdir(parents=True)
    for fix in fixes.all_fixes():
        runs = {release: record for (entry, release), record in results.items() if entry == fix.id}
        entry_page(fix.info, runs, out / "entries")
    if entries_written is not None:
        entries_written()
    (out / "status.md").write_text(status_table(load_results(build, environment=None)))
    (out / "components.md").write_text(components_page())
    (out / "matrix.md").write_text(matrix_page())
    (out / "bisect.md").write_text(bisect_page())
    (out / "coverage.md").write_text(coverage_page())
    (out / checked.PAGE).write_text(checked.checked_page())
    checked.write_scripts(out)
    (out / "search-evidence.json").write_text(json.dumps(search_module.site_data(fixes.all_fixes())))
    releases = measured.load().releases
    (out / "releases").mkdir()
    (out / "releases" / "index.md").write_text(releases_index(releases))
    for release in releases:
        (out / "releases" / f"{release}.md").write_text(release_page(release, releases))
    print(f"site pages generated in {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.site", description=__doc__.splitlines()[0])
    parser.add_argument("--build", type=Path, default=BUILD)
    parser.add_argument("--mkdocs", action="store_true",
                        help="then the site, in this process: the entry pages converted on every core into "
                             "mkdocs-jupyter's cache (begun while the other pages are written), then mkdocs build --strict")
    args = parser.parse_args(argv)
    converting: list[Callable[[], notebook_pages.Converted]] = []
    try:
        generate(args.build, entries_written=(lambda: converting.append(notebook_pages.start_converting()))
                 if args.mkdocs else None)
        if args.mkdocs:
            done = converting.pop()()
            print(f"entry pages: {done.converted} converted, {done.cached} already in mkdocs-jupyter's cache "
                  f"({done.jobs} at once)")
            notebook_pages.mkdocs_build()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        for wait in converting:  # an error above: the conversions still end before this process does
            try:
                wait()
            except Exception:  # noqa: BLE001 - the error above is the one reported
                pass
    return 0

