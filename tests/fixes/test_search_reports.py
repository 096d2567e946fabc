"""fixbook search against real users' words (tests/fixes/data/user_reports.json, ci.bench.search_eval): the reports of
entries, error lines and prose alike, and unrelated reports that share words with entries."""
from __future__ import annotations

import json

from ci.bench import search_eval

TOP1_GOAL = 0.90


def test_when_users_reports_are_searched_then_the_right_entry_is_first_on_nine_of_ten_and_no_unrelated_one_is_strong(
        capsys) -> None:
    parts = search_eval.evaluate()
    with capsys.disabled():  # the figures, in the test output (the held-out part was never tuned on)
        print()
        for name, figures in parts.items():
            print("  " + figures.line(name))
    everything = parts["all"]
    assert everything.top1 >= TOP1_GOAL, everything.misses
    assert everything.strong_negatives == 0, everything.strong


def test_the_labelled_reports_name_their_source_and_a_known_entry_and_both_parts_hold_both_kinds() -> None:
    import fixes

    data = json.loads(search_eval.REPORTS.read_text())
    known = {fix.id for fix in fixes.all_fixes()}
    for report in data["reports"]:
        assert report["source"].startswith("https://") and report["text"].strip(), report
        assert report["entry"] is None or report["entry"] in known, report["entry"]
    for held_out in (False, True):
        part = [r for r in data["reports"] if search_eval.is_held_out(r) == held_out]
        assert {r["kind"] for r in part if r["entry"]} == {"error", "prose"} and any(r["entry"] is None for r in part)
