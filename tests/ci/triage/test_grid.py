"""The rows without an upstream test, decided by the differential sweep's grid: what a fix changed, which cells run
it (the call trace, on a real release), and the decision from the record's verdicts."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ci import differential, triage
from ci.differential import record as record_module
from ci.differential import space as space_module
from ci.triage import grid

SOURCE = '''\
import os

LIMIT = 3


def top(x):
    return x + 1


class Engine:
    name = "e"

    @property
    def size(self):
        return 2

    def step(self):
        def inner():
            return 1
        return inner()
'''


def test_when_a_line_is_in_a_method_then_functions_at_names_it_as_co_qualname_does():
    assert grid.functions_at(SOURCE, [7]) == {"top"}
    assert grid.functions_at(SOURCE, [13, 15]) == {"Engine.size"}  # the decorator line counts for its function
    assert grid.functions_at(SOURCE, [19]) == {"Engine.step.<locals>.inner"}
    assert grid.functions_at(SOURCE, [20]) == {"Engine.step"}


def test_when_a_line_is_outside_every_function_then_the_whole_file_counts():
    assert grid.functions_at(SOURCE, [3]) == {grid.WHOLE_FILE}
    assert grid.functions_at(SOURCE, [11]) == {grid.WHOLE_FILE}  # a class attribute
    assert grid.functions_at("def broken(:\n", [1]) == {grid.WHOLE_FILE}


def test_when_a_diff_changes_removes_and_adds_then_changed_lines_are_those_of_the_old_version():
    diff = """diff --git a/deepspeed/a.py b/deepspeed/a.py
--- a/deepspeed/a.py
+++ b/deepspeed/a.py
@@ -7 +7 @@ def top(x):
-    return x + 1
+    return x + 2
@@ -12,0 +13,2 @@ class Engine:
+    other = 1
+    more = 2
@@ -20,2 +21 @@
-            a
-            b
+            c
diff --git a/deepspeed/new.py b/deepspeed/new.py
--- /dev/null
+++ b/deepspeed/new.py
@@ -0,0 +1 @@
+x = 1
diff --git a/deepspeed/ops/op.cpp b/deepspeed/ops/op.cpp
--- a/deepspeed/ops/op.cpp
+++ b/deepspeed/ops/op.cpp
@@ -1 +1 @@
-a
+b
"""
    assert grid.changed_lines(diff) == {"deepspeed/a.py": {7, 12, 13, 20, 21}}


def test_when_a_cell_ran_a_changed_function_or_any_of_a_whole_file_then_touches_names_it():
    ran = ["deepspeed/a.py:top", "deepspeed/b.py:B.f", "deepspeed/c.py:g"]
    assert grid.touches(ran, {"deepspeed/a.py": ["top", "other"]}) == ["deepspeed/a.py:top"]
    assert grid.touches(ran, {"deepspeed/b.py": [grid.WHOLE_FILE]}) == ["deepspeed/b.py:B.f"]
    assert grid.touches(ran, {"deepspeed/c.py": ["h"], "deepspeed/d.py": [grid.WHOLE_FILE]}) == []


@dataclass
class FakeRecord:
    rows: dict[tuple[str, str], str] = field(default_factory=dict)
    attribution: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def row(self, cell: str, release: str) -> dict[str, Any] | None:
        verdict = self.rows.get((cell, release))
        return None if verdict is None else {"verdict": verdict}

    def attributed(self, cell: str, release: str) -> dict[str, Any] | None:
        return self.attribution.get((cell, release))


ROW = triage.Row(7000, "abc", "0.2.0", "ZeRO-3", "crash", "Fix a thing (#7000)", True)
CHANGED = {"deepspeed/a.py": ["top"]}


def _decide(record: FakeRecord, touched: dict[str, list[str]], citing: dict[int, list[str]] | None = None):
    return grid.decide(ROW, "0.1.0", "0.2.0", CHANGED, touched, record, citing or {})


def test_when_no_cell_runs_the_changed_code_then_the_grid_does_not_detect_it_and_says_it_does_not_reach_it():
    decision = _decide(FakeRecord({("c1", "0.1.0"): "crashes", ("c1", "0.2.0"): "agrees"}), {"c1": ["deepspeed/b.py:f"]})
    assert decision.state == triage.GRID_NOT_DETECTED and "does not reach it" in decision.reason
    assert decision.cells == []


def test_when_a_running_cell_differs_before_and_agrees_after_unexplained_then_the_grid_reproduces_the_row():
    record = FakeRecord({("c1", "0.1.0"): "differs", ("c1", "0.2.0"): "agrees",
                         ("c2", "0.1.0"): "agrees", ("c2", "0.2.0"): "agrees"},
                        {("c1", "0.1.0"): {"status": "unexplained"}})
    decision = _decide(record, {"c1": ["deepspeed/a.py:top"], "c2": ["deepspeed/a.py:top"]})
    assert decision.state == triage.GRID_REPRODUCED, decision
    assert decision.carrying == ["c1"] and decision.cells == ["c1", "c2"]
    assert decision.verdicts == {"c1": "differs -> agrees", "c2": "agrees -> agrees"}


def test_when_the_flip_is_another_entrys_bug_then_it_does_not_count_but_the_citing_entrys_does():
    record = FakeRecord({("c1", "0.1.0"): "crashes", ("c1", "0.2.0"): "agrees"},
                        {("c1", "0.1.0"): {"status": "explained", "entries": ["other-bug"]}})
    touched = {"c1": ["deepspeed/a.py:top"]}
    other = _decide(record, touched)
    assert other.state == triage.GRID_NOT_DETECTED and other.explained == {"c1": "explained by other-bug"}
    assert "not this fix's to claim" in other.reason
    assert _decide(record, touched, {7000: ["other-bug"]}).state == triage.GRID_REPRODUCED


def test_when_the_flipping_cell_also_runs_another_fix_of_the_same_release_then_neither_claims_it():
    record = FakeRecord({("c1", "0.1.0"): "differs", ("c1", "0.2.0"): "agrees"})
    touched = {"c1": ["deepspeed/a.py:top", "deepspeed/lr.py:step"]}
    decision = grid.decide(ROW, "0.1.0", "0.2.0", CHANGED, touched, record, {},
                           {"6597": {"deepspeed/lr.py": ["step"]}, "6000": {"deepspeed/z.py": ["other"]}})
    assert decision.state == triage.GRID_NOT_DETECTED and "#6597" in decision.explained["c1"]
    assert "#6000" not in decision.explained["c1"]


def test_when_the_verdict_is_the_same_on_both_releases_then_the_grid_does_not_detect_it_and_names_the_cells():
    record = FakeRecord({("c1", "0.1.0"): "crashes", ("c1", "0.2.0"): "crashes"})
    decision = _decide(record, {"c1": ["deepspeed/a.py:top"]})
    assert decision.state == triage.GRID_NOT_DETECTED and decision.cells == ["c1"]
    assert "1 cell run the changed code" in decision.reason and decision.verdicts == {"c1": "crashes -> crashes"}


def test_when_a_row_is_decided_then_its_outcome_keeps_why_upstream_had_no_test_and_the_check_accepts_it():
    known = triage.Outcome(ROW.key, ROW.pr, ROW.sha, ROW.component, ROW.symptom, triage.NO_TEST,
                           "the fix commit adds or changes no test function", command="c", date="2026-01-01")
    decision = _decide(FakeRecord(), {"c1": ["deepspeed/b.py:f"]})
    outcome = grid.outcome_for(ROW, known, decision)
    assert outcome.grid["upstream"] == known.reason and outcome.grid["cells"] == []
    assert outcome.command == grid.command(ROW) and outcome.state == triage.GRID_NOT_DETECTED
    again = triage.Outcome.from_json(__import__("dataclasses").asdict(outcome))
    assert again == outcome
    data = {"rows": {ROW.key: __import__("dataclasses").asdict(outcome)}, "entries": {}, "sessions": []}
    assert triage.check(data, rows=[ROW], entries=False) == []
    outside = grid.outcome_for(ROW, known, None, "older than the grid")
    assert outside.state == triage.NO_TEST and "older than the grid" in outside.reason
    assert grid.outcome_for(ROW, outside, None, "older than the grid").reason == outside.reason  # run again: the same


def test_when_upstreams_test_uses_what_the_fix_adds_then_the_grid_decides_and_keeps_that_tests_runs():
    run = triage.ReleaseRun("0.1.0", ["t.py::test"], failed=1)
    known = triage.Outcome(ROW.key, ROW.pr, ROW.sha, ROW.component, ROW.symptom, triage.COULD_NOT_RUN,
                           f"{triage.USES_THE_FIX} (new_api): it cannot run on 0.1.0 at all", runs=[run],
                           command="c", date="2026-01-01")
    assert triage.grid_decides(known)
    assert not triage.grid_decides(triage.Outcome("k", 1, "s", "c", "crash", triage.COULD_NOT_RUN, "timed out on 0.1.0"))
    record = FakeRecord({("c1", "0.1.0"): "crashes", ("c1", "0.2.0"): "agrees"})
    outcome = grid.outcome_for(ROW, known, _decide(record, {"c1": ["deepspeed/a.py:top"]}))
    assert outcome.state == triage.GRID_REPRODUCED and outcome.runs == [run]
    assert outcome.grid["upstream_state"] == triage.COULD_NOT_RUN and outcome.grid["upstream"] == known.reason


def test_when_a_cell_runs_with_the_trace_then_its_answer_names_what_its_ranks_ran():
    """On the newest release, the default cell: the engine's step runs only in the ranks (forked), so the trace
    reaching it shows the hook is inherited; the verdict is the one the record holds."""
    data = record_module.read()
    space = space_module.load()
    release = data.releases[-1]
    cell_id = next(c for c in sorted(data.cells) if (data.row(c, release) or {}).get("verdict") == "agrees"
                   and data.cells[c]["cell"].get("world_size", 1) == 1)
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        answers, failure = differential.run_child(release, {cell_id: {"cell": data.cells[cell_id]["cell"]}},
                                                  dict(space.run), 300, 120, trace=folder)
    assert not failure, failure
    touched = answers[cell_id]["touched"]
    assert answers[cell_id]["verdict"] == "agrees"
    assert "deepspeed/runtime/engine.py:DeepSpeedEngine.step" in touched, touched[:20]
    assert "deepspeed/__init__.py:initialize" in touched
    assert not any(t.endswith(":<module>") for t in touched)
    assert "deepspeed/runtime/engine.py:DeepSpeedEngine" not in touched  # a class body runs at import: not a call


def test_when_a_release_is_older_than_the_record_then_its_older_environment_runs_it():
    from ci import releases as release_env

    spans = [item for item in release_env.older() if item.environment]
    assert spans, "ci/releases.toml names an environment for some older releases"
    older = grid.older_releases()
    assert older and all(grid.older_environment(r) == spans[0].environment for r in older)
    newest_recorded = record_module.read().releases
    assert grid.older_environment(newest_recorded[-1]) is None


def test_when_an_older_releases_flip_may_be_a_known_entrys_bug_then_it_is_not_claimed_and_says_so():
    record = FakeRecord({("c1", "0.1.0"): "crashes", ("c1", "0.2.0"): "agrees"},
                        {("c1", "0.1.0"): {"status": "candidates", "entries": ["known-bug"]}})
    decision = _decide(record, {"c1": ["deepspeed/a.py:top"]})
    assert decision.state == triage.GRID_NOT_DETECTED
    assert decision.explained["c1"].startswith("may be the bug of known-bug")


def test_when_an_older_environments_flip_does_not_show_again_then_again_names_it(monkeypatch):
    view = grid.Measured({"0.1.0": {"c1": {"verdict": "differs"}, "c2": {"verdict": "differs"}},
                          "0.2.0": {"c1": {"verdict": "agrees"}, "c2": {"verdict": "agrees"}}},
                         {"c1": {}, "c2": {}}, [])
    answers = {"0.1.0": {"c1": {"verdict": "agrees"}, "c2": {"verdict": "differs"}},
               "0.2.0": {"c1": {"verdict": "agrees"}, "c2": {"verdict": "agrees"}}}
    monkeypatch.setattr(differential, "run_child", lambda release, cells, *args, **kwargs: (answers[release], ""))
    assert grid.again(view, ["c1", "c2"], ("0.1.0", "0.2.0"), "torch-2.3") == {"c1"}
    view.flaky = {"c1"}
    assert view.attributed("c1", "0.1.0") == {"status": "flaky"}
