"""An entry's card: every fact about one bug, rendered from where it is stated once.

The title, summary, symptom (or kind: a behaviour change), components, root cause, upstream links and error text come from the
entry's :class:`~fixes.fix.FixInfo`; the affected range, the first fixed release and the fix's
coverage from the release sweep (``fixes/data/sweep.json``); where the notebook has run (CPU, GPU)
from the run history (``fixes/data/runs.json``), and which accelerator measured what (:mod:`fixes.accelerators`).
The notebook shows the card at its top (:func:`show`), the site puts the same card at the top of the entry's page,
and nothing retypes it.
Stdlib only.
"""
from __future__ import annotations

from . import measured

# Where the site is published (mkdocs.yml's site_url; a test keeps the two equal).
SITE_URL = "https://deepspeed-fixbook.github.io/deepspeed-fixbook/"


def release_page_url(release: str) -> str:
    """The site's page of one DeepSpeed release: its known bugs, measured."""
    return f"{SITE_URL}generated/releases/{release}/"
from .fix import FixInfo
from .record import PASSING, RunSummary, gpu_status, history


def measured_rows(info: FixInfo, matrix_link: str = "") -> list[str]:
    """The card's rows that come from the release sweep."""
    sweep, data = info.sweep, measured.load()
    if not sweep.observations:
        return [f"| **{'Has the new behaviour' if info.is_behaviour_change else 'Affected'} (measured)** | not swept yet |"]
    swept = f"{len(sweep.releases)} releases {sweep.releases[0]} – {sweep.releases[-1]}"
    when = (data.full_run or data.last_run).get("at", "")
    under = f", measured under {info.measured_under}" if info.measured_under else ""
    link = f"; [matrix]({matrix_link})" if matrix_link else ""
    where = f"environment cpu: torch {data.torch}, Python {data.python}"
    if info.is_behaviour_change:  # "affected" = has the new behaviour; "fixed" = the old one is back
        rows = [f"| **Has the new behaviour (measured)** | {sweep.range_text} (swept {swept}"
                f"{', ' + when if when else ''}; {where}{under}{link}) |",
                f"| **Old behaviour back (measured)** | {sweep.first_fixed or 'no: every release swept since has it'} |"]
    else:
        rows = [f"| **Affected (measured)** | {sweep.range_text} (swept {swept}{', ' + when if when else ''}; {where}{under}{link}) |",
                f"| **First fixed (measured)** | {sweep.first_fixed or 'none yet: the newest release swept is affected'} |"]
    rows += [
            f"| **Upstream says** | {_upstream_says(info)} |",
            f"| **Fix works (measured)** | {sweep.coverage_text}: applied and re-checked on each affected release "
            "by the sweep" + ("; here the fix pins the old behaviour" if info.is_behaviour_change else "") + " |"]
    unfixable: dict[str, list[str]] = {}  # one row per distinct reason
    for release in sweep.unfixable:
        observation = sweep.get(release)
        assert observation is not None
        reason = observation.fix_reason.split(": its fingerprint is")[0]  # the fingerprints are in the file
        unfixable.setdefault(f"{observation.fix}: {reason}", []).append(release)
    for reason, where in unfixable.items():
        rows.append(f"| **No fix for {measured.compress(where, sweep.releases)}** | {reason} |")
    for name, other in sorted(data.environments.items()):
        theirs = other.entry(info.id)
        if theirs.observations:
            cannot = theirs.with_status("could not run")
            rows.append(f"| **Affected (measured, environment {name}: torch {other.torch}, Python {other.python})** | "
                        f"{theirs.range_text}; fix works: {theirs.coverage_text}"
                        + (f"; could not run on {measured.compress(cannot, theirs.releases)}" if cannot else "") + " |")
    if info.upstream_disagreement:
        rows.append(f"| **Measured vs upstream** | ⚠ differs: {info.upstream_disagreement} |")
    for status in ("could not run", "inconsistent"):
        if sweep.with_status(status):
            first = sweep.get(sweep.with_status(status)[0])
            assert first is not None
            rows.append(f"| **{status.capitalize()}** | {', '.join(sweep.with_status(status))} "
                        f"(e.g. {first.release}: {first.reason}) |")
    return rows


def _upstream_says(info: FixInfo) -> str:
    if info.is_behaviour_change:
        text = f"changed on purpose in {info.upstream_introduced}" if info.upstream_introduced else "changed on purpose"
        return text + (f", reverted in {info.upstream_fixed_in}" if info.upstream_fixed_in else "; not a bug")
    return (f"{'fixed in ' + info.upstream_fixed_in if info.upstream_fixed_in else 'not fixed'}"
            + (f", introduced in {info.upstream_introduced}" if info.upstream_introduced else ""))


def runs_row(info: FixInfo, runs: list[RunSummary] | None = None) -> str:
    """Where the notebook passed, per device and environment, from the run history."""
    runs = history() if runs is None else runs
    mine = [r for r in runs if r.entry == info.id and r.device == "cpu" and r.verdict in PASSING]
    by_env: dict[str, list[str]] = {}
    for run in mine:  # the date each ran, from the run history (not the date the page was built)
        by_env.setdefault(f"{run.environment}: Python {run.python}, torch {run.torch}", []).append(
            f"{run.release} on {run.at}")
    cpu = "; ".join(f"DeepSpeed {', '.join(sorted(set(rels)))} ({env})" for env, rels in sorted(by_env.items()))
    return f"| **Notebook passed** | CPU: {cpu or 'no run recorded'} · GPU: {gpu_status(info.id, runs)} |"


def accelerators_row(info: FixInfo, runs: list[RunSummary] | None = None) -> str:
    """Which accelerator measured what (:mod:`fixes.accelerators`): CPU, CUDA in one process, CUDA with the ranks
    on CPU."""
    from .accelerators import measured as accelerators

    return f"| **Measured on** | {accelerators(info.id, runs).text} |"


def upstream_test_rows(info: FixInfo) -> list[str]:
    """Upstream's own test from each fix PR the entry cites, run on the entry's last affected release without and
    with ``fixes.apply()`` on CPU (``python -m ci.triage --entries``), from ``fixes/data/upstream_fixes.json``."""
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parent / "data" / "upstream_fixes.json"
    results = json.loads(data.read_text()).get("entry_tests", {}).get(info.id, []) if data.exists() else []
    if not info.upstream_prs:
        return ["| **Upstream's own test** | no upstream fix PR, so no upstream test |"]
    rows = []
    for pr in info.upstream_prs:
        result = next((r for r in results if r["pr"] == pr), None)
        if result is None:
            text = "not run yet"
        elif "verdict" not in result:
            text = (f"PR #{pr} ships no test" if result.get("state") == "no upstream test" else
                    f"could not run: {result.get('reason', '')}")
        else:
            def counts(side: dict) -> str:
                return ", ".join(f"{side[k]} {k}" for k in ("passed", "failed", "skipped", "errors") if side[k])
            tests = result["tests"]
            named = tests[0].split("::", 1)[-1] + (f" and {len(tests) - 1} more" if len(tests) > 1 else "")
            text = (f"{result['verdict']}: PR #{pr}'s `{named}` on DeepSpeed {result['release']} (CPU), without the "
                    f"fix {counts(result['without'])}; with `fixes.apply()` {counts(result['with'])}")
            if result["with"]["failing"]:
                text += f" (still failing: {', '.join(f.split('::')[-1] for f in result['with']['failing'][:4])})"
            if result.get("reason") and not result["verdict"].startswith("the fix makes"):
                text += f"; measured: {' '.join(result['reason'].split())}".replace("|", "\\|")  # why it still fails, could not run or does not count
            text += f" ({result['date']}; `{result['command']}`)"
        rows.append(f"| **Upstream's own test (PR #{pr})** | {text} |")
    return rows


def trigger_rows(info: FixInfo) -> list[str]:
    """The jobs that hit the bug (the entry's trigger), and the grid that measured it (``python -m ci.sweep.triggers``)."""
    from .registry import get
    from .trigger import recorded_grid

    trigger = get(info.id).trigger
    if trigger is None:
        return ["| **Triggered by** | not stated yet |"]
    rows = [f"| **Triggered by** | {trigger.text()} (`fixbook doctor --config ds_config.json` checks a job) |"]
    grid = recorded_grid(info.id, trigger)
    if grid is None:
        return rows + ["| **Trigger measured** | not yet |"]
    cells = "; ".join(f"{cell.label}: {'reproduces' if cell.reproduced else 'does not' if cell.reproduced is False else 'could not run'}"
                      + (" ✗ the trigger disagrees" if cell.agrees is False else "") for cell in grid.cells)
    agreed = sum(cell.agrees is True for cell in grid.cells)
    measured = sum(cell.agrees is not None for cell in grid.cells)
    return rows + [f"| **Trigger measured** | on DeepSpeed {grid.release} ({grid.date}), each condition flipped on its "
                   f"own; the trigger agrees on {agreed} of {measured} cells: {cells} |"]


CHECKED_SHOWN = 6  # the cells a card links; the page lists every one


def checked_row(info: FixInfo) -> list[str]:
    """The differential sweep's cells that showed this entry's bug (its fix made them agree), linked to the site's
    "Configurations checked" page."""
    from .checked import read

    rows = read().showed(info.id)
    if not rows:
        return []
    links = ", ".join(f"[{cell}]({SITE_URL}generated/checked/#cell-{cell}) on {release}"
                      for cell, release in rows[:CHECKED_SHOWN])
    more = f" and {len(rows) - CHECKED_SHOWN} more" if len(rows) > CHECKED_SHOWN else ""
    return [f"| **Configurations checked** | {len(rows)} checked against PyTorch showed this bug (the fix made them "
            f"agree): {links}{more} |"]


def related_ids(info: FixInfo) -> list[str]:
    """The entries ``info`` names as related, and those that name it (a link is stated at one end only)."""
    from .registry import all_fixes

    named_by = [fix.info.id for fix in all_fixes() if info.id in fix.info.related]
    return sorted(set(info.related) | set(named_by))


def related_row(info: FixInfo) -> list[str]:
    ids = related_ids(info)
    return [f"| **Related** | {', '.join(f'`{i}`' for i in ids)} (same cause or same symptom: see its page) |"] if ids else []


def card(info: FixInfo, matrix_link: str = "", runs: list[RunSummary] | None = None) -> str:
    """The entry card as Markdown (no title: the notebook and the page carry ``info.title``)."""
    upstream = ", ".join(f"[{name}]({url})" for name, url in info.links) or "none filed upstream"
    status = info.upstream_note or (f"fixed in {info.upstream_fixed_in}" if info.upstream_fixed_in else "open")
    signatures = "\n".join(f"    {s}" for s in info.error_signatures)
    fix = f"`{info.apply_call}`"
    if info.is_behaviour_change:
        fix += (" pins the old behaviour (only when named: `fixes.apply()` with no ids leaves a behaviour change "
                "alone)")
    kind = ([f"| **Kind** | behaviour change: not a bug, an intended upstream change that alters results for "
             "configs relying on the old behaviour; *affected* means *has the new behaviour* |"]
            if info.is_behaviour_change else [])
    found = [f"| **Found by** | the Fixbook: {info.found_by} |"] if info.found_by else []
    rows = ["| | |", "|---|---|", f"| **Entry id** | `{info.id}` |", *kind, *found, *measured_rows(info, matrix_link),
            f"| **Upstream** | {upstream} |", f"| **Upstream status** | {status} |",
            f"| **{'What changed' if info.is_behaviour_change else 'Root cause'}** | {info.root_cause} |",
            f"| **Fix** | {fix} |", *trigger_rows(info), *checked_row(info), *upstream_test_rows(info), *related_row(info), runs_row(info, runs),
            accelerators_row(info, runs)]
    return (f"**{info.label}** · {', '.join(info.components)} — {info.summary}\n\n" + "\n".join(rows)
            + f"\n\nError text this entry explains:\n\n{signatures}\n")


def show(fix_id: str) -> str:
    """Display the card of ``fix_id`` in a notebook (as Markdown; printed elsewhere) and return it."""
    from .registry import get

    text = card(get(fix_id).info)
    try:
        from IPython.display import Markdown, display
    except ImportError:
        print(text)
    else:
        display(Markdown(text))
    return text
