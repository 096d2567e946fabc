"""The site's page "Configurations checked": the differential sweep's record (``fixes/data/differential.json``, read
through :mod:`fixes.checked`) per release: cells that agree with plain PyTorch, differ or crash, which entries
explain them, and those not explained yet, each with its configuration and the command that measures it again."""
from __future__ import annotations

import re
from pathlib import Path

from fixes import checked

PAGE = "checked.md"
SCRIPTS = "scripts"  # beside the page: each minimised configuration's standalone script
JUDGED = ("agrees", "differs", "crashes", "rejected", "could not run")


def anchor(cell_id: str) -> str:
    """The page's anchor of one cell (entry cards link it)."""
    return f"cell-{cell_id}"


def link(cell_id: str) -> str:
    """A link to one cell's row, written as HTML: the page links thousands of cells, and Python-Markdown's inline
    link pattern scans ahead for each ``[``'s closing bracket (the page with 2,408 links, measured: 0.79 s to
    render against 3.95 s as Markdown links)."""
    return f'<a href="#{anchor(cell_id)}">{cell_id}</a>'


def checked_page(record: checked.Record | None = None) -> str:
    record = checked.read() if record is None else record
    # Out of the site's search index (Material's front matter): a table of cells and verdicts, which the entry
    # cards and `fixbook doctor --config` link; what a user searches for (error text, symptoms) is on the entry pages.
    lines = ["---", "search:", "  exclude: true", "---", "", "# Configurations checked", "",
             "Each configuration below (a *cell*: ZeRO stage, precision, gradient accumulation, world size, optimizer, "
             "scheduler, checkpointing and more, chosen so that every pair of values users run appears in one) trains a "
             "tiny model a few optimizer steps through DeepSpeed and the same model in plain PyTorch, on the same data "
             "and initialisation; the losses, gradient norms and parameters of every step are compared under the "
             "tolerance of the precision. A difference or crash is *explained* by an entry when the entry's trigger "
             "holds for the cell, its measured range holds the release, and with the entry's fix applied the cell "
             "agrees; a difference that did not show when run again is *flaky*. `fixbook doctor --config "
             "ds_config.json` names the cells closest to a job.", ""]
    if not record.rows:
        return "\n".join(lines + ["No configuration has been checked yet.", ""])
    lines += [f"Recorded {record.checked or 'at an unknown time'}; {len(record.cells)} cells.", "",
              "| Release | agree | differ | crash | explained | flaky | not explained yet | rejected by DeepSpeed | "
              "could not run |", "|---|---|---|---|---|---|---|---|---|"]
    unexplained: list[tuple[str, str, dict]] = []
    for release in record.releases:
        found = {v: 0 for v in JUDGED}
        status = {"explained": 0, "flaky": 0, "unexplained": 0, "not attributed": 0}
        for cell_id, by_release in record.rows.items():
            row = by_release.get(release)
            if row is None:
                continue
            found[row["verdict"]] += 1
            if row["verdict"] in ("differs", "crashes"):
                attribution = record.attributed(cell_id, release)
                key = attribution["status"] if attribution else "not attributed"
                status[key] += 1
                if key in ("unexplained", "not attributed"):
                    unexplained.append((cell_id, release, row))
        open_ = status["unexplained"] + status["not attributed"]
        lines.append(f"| {release} | {found['agrees']} | {found['differs']} | {found['crashes']} | "
                     f"{status['explained']} | {status['flaky']} | {open_} | {found['rejected']} | "
                     f"{found['could not run']} |")
    entries: dict[str, list[tuple[str, str]]] = {}
    for cell_id, by_release in record.attribution.items():
        for release, found in by_release.items():
            if found.get("status") == "explained":
                for entry in found["entries"]:
                    entries.setdefault(entry, []).append((cell_id, release))
    lines += ["", "## Explained by entries", ""]
    if entries:
        lines += ["| Entry | cells that showed its bug (release) |", "|---|---|"]
        for entry in sorted(entries):
            rows = ", ".join(f"{link(c)} ({r})" for c, r in sorted(entries[entry], key=lambda x: (x[1], x[0])))
            lines.append(f"| [{entry}](entries/{entry}.ipynb) | {rows} |")
    else:
        lines.append("None yet.")
    lines += ["", "## Not explained yet", "",
              "Differences and crashes no entry explains: the next candidates for entries. *Smallest configuration*: "
              "the cell with every setting that does not change how it fails moved back to its default, and the "
              "releases on which that configuration fails the same way.", ""]
    if unexplained:
        lines += ["| Cell | release | verdict | what | smallest configuration | measure it again |",
                  "|---|---|---|---|---|---|"]
        for cell_id, release, row in sorted(unexplained, key=lambda x: (x[0], x[1])):
            what = (f"max difference {row['max_diff']:.3g} at step {row.get('first_step')} in {row.get('quantity')}"
                    if row["verdict"] == "differs" else _without_directories(str(row.get("error", "")))[:160])
            minimal = record.minimal_for(cell_id, release)
            lines.append(f"| {link(cell_id)} | {release} | {row['verdict']} | {_cell(what)} | "
                         f"{_cell(_minimal(minimal[1])) if minimal else 'not minimised yet'} | "
                         f"`{row.get('command', '')}` |")
    else:
        lines.append("None.")
    lines += ["", "## Scripts to file upstream", "",
              "Each smallest configuration above as a standalone script (torch and DeepSpeed only): it trains the tiny "
              "model through DeepSpeed and in plain PyTorch, prints each step's comparison and a last line `verdict: "
              "...`, and exits 1 unless they agree. Each was run on the newest release its configuration fails on and "
              "the newest it agrees on; *as recorded* says whether it printed there what the sweep measured.", ""]
    written = scripts(record)
    if written:
        lines += ["| Script | smallest configuration | what it printed | as recorded |", "|---|---|---|---|"]
        for name, (_, group) in written.items():
            printed = ", ".join(f"{release}: {verdict}" for release, verdict in group["script"]["checked"].items())
            values = ", ".join(f"{k}={v}" for k, v in group.get("set", {}).items()) or "every default"
            lines.append(f"| [{name}]({SCRIPTS}/{name}) | {_cell(values)} | {_cell(printed)} | "
                         f"{'yes' if group['script'].get('matches') else 'no'} |")
    else:
        lines.append("None yet.")
    lines += ["", "## The cells", "", "| Cell | configuration | " + " | ".join(record.releases) + " |",
              "|---|---|" + "---|" * len(record.releases)]
    for cell_id in sorted(record.cells):
        marks = []
        for release in record.releases:
            row = record.rows.get(cell_id, {}).get(release)
            attribution = record.attributed(cell_id, release)
            mark = row["verdict"] if row else ""
            if attribution and attribution.get("status") == "explained":
                mark += " (" + ", ".join(attribution["entries"]) + ")"
            elif attribution:
                mark += f" ({attribution['status']})"
            marks.append(mark)
        lines.append(f"| <span id=\"{anchor(cell_id)}\"></span>`{cell_id}` | {_cell(checked.describe(record.cells[cell_id]))} | "
                     + " | ".join(marks) + " |")
    return "\n".join(lines) + "\n"


def scripts(record: checked.Record | None = None) -> dict[str, tuple[str, dict]]:
    """{file name: (standalone script, a minimised group it belongs to)} for every minimised group whose script was
    written and run (``python -m ci.differential --scripts``); one script per minimal configuration."""
    from fixes.harness import standalone

    record = checked.read() if record is None else record
    found: dict[str, tuple[str, dict]] = {}
    for key in sorted(record.minimised):
        group = record.minimised[key]
        if group.get("script", {}).get("checked"):
            name, text = standalone.for_group(group, record.torch, record.python)
            found.setdefault(name, (text, group))
    return found


def write_scripts(out: Path, record: checked.Record | None = None) -> int:
    """The scripts into ``out/scripts/`` (the site serves them beside the page); how many."""
    written = scripts(record)
    (out / SCRIPTS).mkdir(parents=True, exist_ok=True)
    for name, (text, _) in written.items():
        (out / SCRIPTS / name).write_text(text)
    return len(written)


def _without_directories(text: str) -> str:
    """An error line with the directories of any absolute path dropped (a run's temporary checkpoint folder, say):
    no machine path reaches the page."""
    return re.sub(r"(?:/[\w.+-]+)+/", "", text)


def _minimal(found: dict) -> str:
    """A minimised group in a cell of the table: the values it sets and the releases it fails on."""
    values = ", ".join(f"{name}={value}" for name, value in found.get("set", {}).items()) or "every default"
    shown = sum(sig == found["signature"] for sig in found.get("releases", {}).values())
    where = (f"{found['signature']} on {found['first']} - {found['last']} ({shown} of {len(found['releases'])} releases)"
             if found.get("first") else "not reproduced on any release")
    script = found.get("script", {})
    return f"{values}; {where}" + (f"; [script]({SCRIPTS}/{checked.script_name(found['minimal'])})"
                                   if script.get("checked") else "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
