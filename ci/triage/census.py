"""The upstream census as project data: every DeepSpeed bug-fix commit since 0.14.0's release, triaged.

    python -m ci.triage.census          # rebuild fixes/data/upstream_fixes.json from the TSVs and the entries
    python -m ci.triage.census --check  # exit 1 if the committed file is not what the TSVs and the entries give

Sources (:data:`ci.triage.CENSUS`, the same columns, no commit in two): ``ci/data/census-0.14-0.15.tsv``, the fixes
first released in 0.14.1 – 0.16.0, read from the DeepSpeed git history (``v0.14.0..v0.16.0``, the first release
being the first tag that contains the commit), and ``ci/data/census.tsv``, those since, copied from
``../shared/research/census-fixes-0.16.0-to-2026-08.tsv`` so a clean clone has it. Each row is a quick read of one
commit's message and diff: a starting point, not a measurement. For each row the file keeps what the TSV says,
what was checked and how, and the triage status:

* ``check`` — ``measured`` where a Fixbook entry cites the PR: the release sweep measured where the
  bug stops (its first fixed release), which confirms or corrects the TSV's first release;
  otherwise ``unchecked`` with the reason (the row carries no code signature to look for, and the
  upstream repository is not reachable from this machine).
* ``upstream_test`` — what ``python -m ci.triage`` measured with upstream's own fix-PR test
  (``ci/data/triage.json``): its state, the releases before and after the fix, the tests, the command, the date.
* ``triage`` (user-visible rows likely reproducible on CPU, the backlog) — ``entry`` (with its id)
  where an entry measures this fix, else the upstream-test state, else ``not tried`` (with the entries that
  cite it as context). A state set by hand in ``ci/data/census_triage.toml`` (``duplicate of`` with the entry,
  say) wins over both, with what was tried.
"""
from __future__ import annotations

import argparse
import json
import sys
import tomllib
from pathlib import Path
from typing import Any

from .. import ROOT

from . import CENSUS as SOURCES
from . import CENSUS_TRIAGE
from . import census_records

TRIAGE = CENSUS_TRIAGE
DATA = ROOT / "fixes" / "data" / "upstream_fixes.json"
# Where no entry measures a row, how its source placed the fix in its first release.
UNCHECKED = {
    "census.tsv": ("the census row names no code to look for and the upstream repository is not reachable from this "
                   "machine, so its first release was not checked against the installed code"),
    "census-0.14-0.15.tsv": ("the census's first release is the first DeepSpeed release tag that contains the fix "
                             "commit, read from the git history; it was not checked against the installed code"),
}


def _release(raw: str) -> str | None:
    return raw[1:] if raw.startswith("v") else None  # "unreleased-after-0.19.5": none yet in the snapshot


def build() -> dict[str, Any]:
    import fixes

    citing: dict[int, list[Any]] = {}
    for fix in fixes.all_fixes():
        for pr in fix.info.upstream_prs:
            citing.setdefault(pr, []).append(fix)
    from .. import triage as triage_module

    manual = tomllib.loads(TRIAGE.read_text()).get("rows", {}) if TRIAGE.exists() else {}
    measured_by_test = triage_module.outcomes()
    rows = []
    for row in census_records(SOURCES):
        pr = int(row["pr"]) if row["pr"] else None  # one commit went in without a PR
        first = _release(row["first_release"])
        entries = citing.get(pr, []) if pr else []
        item: dict[str, Any] = {
            "pr": pr, "sha": row["sha"], "subject": row["subject"], "component": row["component"],
            "symptom": row["symptom"], "user_visible": row["user_visible"] == "yes",
            "cpu_reproducible": row["cpu_reproducible"], "note": row["note"],
            "first_release": first, "census_first_release": row["first_release"],
        }
        # An entry whose upstream fix release is this row's is measuring this fix: its sweep's first
        # fixed release checks the census. Other citing entries name the PR as context only.
        fixing = [f for f in entries if first and f.info.upstream_fixed_in == first]
        if fixing:
            measured = [(f.id, f.info.sweep.first_fixed) for f in fixing]
            fixed = sorted({m for _, m in measured if m})
            item["check"] = {"status": "measured", "how": "; ".join(
                f"entry {entry} (upstream: fixed by this PR in {first}): the sweep measured first fixed "
                f"{m or 'none (still affected)'}" for entry, m in measured)}
            if fixed and first not in fixed:
                item["check"]["correction"] = (f"the census says {first}; measured fixed from {', '.join(fixed)}")
                item["first_release"] = fixed[0]
        else:
            unchecked = UNCHECKED[row["source"]]
            why = unchecked if first else f"{unchecked}; the census snapshot predates its release ({row['first_release']})"
            if entries:
                why += f"; cited by {', '.join(f.id for f in entries)} as context, not as the fix it measures"
            item["check"] = {"status": "unchecked", "how": why}
        tested = measured_by_test.get(str(pr) if pr else row["sha"])
        if tested is not None:
            item["upstream_test"] = {"state": tested.state, "reason": tested.reason, "before": tested.before,
                                     "after": tested.after, "tests": tested.tests, "command": tested.command,
                                     "date": tested.date,
                                     "edits": sorted({e for run in tested.runs for e in run.edits})}
        if item["user_visible"] and row["cpu_reproducible"] == "likely":
            given = manual.get(str(pr))
            if fixing:
                item["triage"] = {"status": "entry", "entry": fixing[0].id}
            elif given:
                item["triage"] = dict(given)
            elif tested is not None:
                item["triage"] = {"status": tested.state}
                if entries:
                    item["triage"]["related"] = [f.id for f in entries]
            else:
                item["triage"] = {"status": "not tried"}
                if entries:
                    item["triage"]["related"] = [f.id for f in entries]
        rows.append(item)
    return {"sources": [path.name for path in SOURCES], "rows": rows,
            "entry_tests": entry_tests(triage_module.load()["entries"])}


def entry_tests(recorded: dict[str, Any], cited: dict[str, tuple[int, ...]] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Per entry, upstream's own fix-PR test run on the entry's last affected release without and with
    ``fixes.apply()`` (``python -m ci.triage --entries``), in brief: what each entry card shows. ``cited``: each
    entry's upstream PRs (default: the registered entries'); a record of a PR the entry no longer cites, or of an
    entry that is gone, is left out."""
    if cited is None:
        import fixes

        cited = {fix.id: tuple(fix.info.upstream_prs) for fix in fixes.all_fixes()}
    counts = ("passed", "failed", "skipped", "errors")
    found: dict[str, list[dict[str, Any]]] = {}
    for result in recorded.values():
        if result["pr"] not in cited.get(result["entry"], ()):
            continue
        brief = {key: result[key] for key in ("pr", "release", "command", "date", "tests", "verdict", "state", "reason",
                                              "proof", "selection") if key in result}
        for side in ("without", "with"):
            if side in result:
                brief[side] = {key: result[side][key] for key in counts}
                brief[side]["failing"] = result[side]["failing"]
                brief[side]["edits"] = result[side]["edits"]
                brief[side]["fix_log"] = result[side].get("fix_log", [])
                brief[side]["pytest"] = result[side].get("pytest", "")
                brief[side]["duration_s"] = result[side].get("duration_s")
        found.setdefault(result["entry"], []).append(brief)
    return {entry: sorted(results, key=lambda r: r["pr"] or 0) for entry, results in sorted(found.items())}


def dumps(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.triage.census", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = dumps(build())
    if args.check:
        if not DATA.exists() or DATA.read_text() != text:
            print(f"{DATA.relative_to(ROOT)} is out of date: python -m ci.triage.census", file=sys.stderr)
            return 1
        return 0
    DATA.write_text(text)
    rows = json.loads(text)["rows"]
    print(f"{len(rows)} rows, {sum(r['user_visible'] for r in rows)} user-visible, "
          f"{sum(1 for r in rows if 'triage' in r)} in the backlog; "
          f"{sum(1 for r in rows if r['check']['status'] == 'measured')} checked by measurement")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
