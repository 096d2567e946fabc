"""The upstream census as data: built from the TSVs, every row checked or saying why not; the second tier of search."""
import csv
import json

import pytest

from ci.triage import census
from fixes import search as search_module
from fixes.cli import main

from ci import triage

STATUSES = {"entry", "planned", "does not reproduce here", "duplicate of", "not tried", *triage.STATES}
SUPEROFFLOAD_TRACEBACK = """Traceback (most recent call last):
  File "/home/user/train.py", line 48, in <module>
    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=ds_config, model_parameters=model.parameters())
  File "/usr/local/lib/python3.11/site-packages/deepspeed/runtime/engine.py", line 1768, in _configure_zero_optimizer
    optimizer = SuperOffloadOptimizer_Stage3(
  File "/usr/local/lib/python3.11/site-packages/deepspeed/runtime/superoffload/superoffload_stage3.py", line 37, in __init__
    super().__init__(module, init_optimizer, timers, ds_config, **kwargs)
TypeError: DeepSpeedZeroOptimizer_Stage3.__init__() got multiple values for argument 'param_names'"""


def test_when_the_data_is_built_from_the_tsvs_then_every_row_of_each_is_there_checked_or_saying_why_not():
    source = []
    for path in census.SOURCES:
        with path.open() as handle:
            source += list(csv.DictReader(handle, delimiter="\t"))
    data = census.build()
    assert len(census.SOURCES) == 2 and len(data["rows"]) == len(source)
    assert [r["sha"] for r in data["rows"]] == [r["sha"] for r in source]
    assert data["sources"] == [path.name for path in census.SOURCES]
    for row in data["rows"]:
        assert row["check"]["status"] in ("measured", "unchecked") and row["check"]["how"], row["pr"]
    backlog = [r for r in data["rows"] if "triage" in r]
    assert len(backlog) == sum(1 for r in source if r["user_visible"] == "yes" and r["cpu_reproducible"] == "likely")
    assert all(r["triage"]["status"] in STATUSES for r in backlog)
    assert any(r["triage"]["status"] == "entry" for r in backlog)
    assert census.main(["--check"]) == 0, "fixes/data/upstream_fixes.json is stale: python -m ci.triage.census"


def test_when_an_error_names_a_known_upstream_fix_then_it_is_listed_in_the_second_tier():
    [found] = [m for m in search_module.upstream(SUPEROFFLOAD_TRACEBACK, "0.18.2") if m.pr == 7715]
    assert "SuperOffloadOptimizer_Stage3" in found.named and found.first_release == "0.18.4"
    assert "predates this fix" in found.release_note


def test_when_the_cli_answers_then_the_second_tier_comes_after_every_proven_entry(capsys):
    text = SUPEROFFLOAD_TRACEBACK + "\nRuntimeError: Output 0 of SplitBackward0 is a view and is being modified inplace"
    assert main(["search", text, "--release", "0.18.2"]) == 0
    out = capsys.readouterr().out
    assert out.index("zero12-flat-buffer-detach") < out.index("Known upstream fixes") < out.index("PR #7715")
    assert "no entry: no notebook proof, no fix module" in out


def test_when_upstreams_test_reproduced_a_row_then_the_second_tier_and_doctor_say_so(monkeypatch, capsys):
    rows = [dict(r) for r in search_module.upstream_rows()]
    [row] = [r for r in rows if r["pr"] == 7715]
    row["upstream_test"] = {"state": triage.REPRODUCED, "before": "0.18.3", "after": "0.18.4", "reason": "r"}
    monkeypatch.setattr(search_module, "upstream_rows", lambda: (row,))
    [found] = [m for m in search_module.upstream(SUPEROFFLOAD_TRACEBACK, "0.18.2") if m.pr == 7715]
    assert found.upstream_test == "reproduced by upstream's test on CPU (0.18.3 fails, 0.18.4 passes) — no entry yet"
    assert main(["search", SUPEROFFLOAD_TRACEBACK, "--release", "0.18.2"]) == 0
    assert "reproduced by upstream's test on CPU (0.18.3 fails, 0.18.4 passes)" in capsys.readouterr().out
    assert search_module.upstream_reproduced_lacking("0.18.2") == {row["component"]: 1}
    assert search_module.upstream_reproduced_lacking("0.18.4") == {}


def test_when_an_unrelated_error_is_searched_then_no_known_upstream_fix_is_offered_either():
    queries = json.loads((census.ROOT / "tests/fixes/data/search_queries.json").read_text())
    offered = {q["name"]: [m.pr for m in search_module.upstream(q["query"])] for q in queries if not q["expect"]}
    assert not any(offered.values()), offered


def test_when_an_entry_no_longer_cites_a_pr_then_its_old_upstream_test_record_is_left_out():
    recorded = {"e#1": {"entry": "e", "pr": 1, "release": "0.19.3", "state": "no upstream test"},
                "e#2": {"entry": "e", "pr": 2, "release": "0.19.3", "state": "no upstream test"},
                "gone#3": {"entry": "gone", "pr": 3, "release": "0.19.3", "state": "no upstream test"}}
    assert census.entry_tests(recorded, cited={"e": (2,)}) == {"e": [{"pr": 2, "release": "0.19.3",
                                                                       "state": "no upstream test"}]}


def test_when_the_census_files_are_read_then_each_span_of_first_releases_is_its_own_and_no_fix_is_twice():
    from fixes.versions import parse

    spans = []
    for path in census.SOURCES:
        released = [r["first_release"][1:] for r in triage.census_records([path]) if r["first_release"].startswith("v")]
        spans.append((min(released, key=parse), max(released, key=parse)))
    (old_first, old_last), (new_first, _) = spans
    assert (old_first, old_last) == ("0.14.1", "0.16.0") and parse(old_last) < parse(new_first), spans
    records = triage.census_records()
    assert len({r["sha"] for r in records}) == len(records)  # census_records raises on a repeated commit anyway


def test_when_two_census_files_hold_the_same_fix_then_reading_them_fails_naming_both_places(tmp_path):
    header = "sha\tpr\tfirst_release\tcomponent\tuser_visible\tsymptom\tcpu_reproducible\tsubject\tds_dirs\tintroduced_in\tnote\tdate\n"
    line = "abc123456\t5353\tv0.14.1\tMoE\tyes\tcrash\tlikely\tEnsure capacity (#5353)\tdeepspeed/moe\t\tn\t2024-04-05\n"
    first, second = tmp_path / "a.tsv", tmp_path / "b.tsv"
    first.write_text(header + line)
    second.write_text(header + line.replace("abc123456", "def456789"))  # another commit, the same PR
    assert [r.key for r in triage.census_rows([first])] == ["5353"]
    with pytest.raises(triage.TriageError, match=r"census row #5353 is in a.tsv line 2 and again in b.tsv line 2"):
        triage.census_rows([first, second])


def test_when_the_grid_decided_a_row_then_its_search_line_says_what_the_grid_showed():
    grid_row = {"upstream_test": {"state": triage.GRID_REPRODUCED, "before": "0.15.2", "after": "0.15.3"}}
    assert search_module.upstream_test_line(grid_row) == (
        "the fix PR ships no usable test; a differential-sweep cell that runs the changed code fails on 0.15.2 and "
        "agrees on 0.15.3 — no entry yet")
    quiet = {"upstream_test": {"state": triage.GRID_NOT_DETECTED, "before": "0.15.2", "after": "0.15.3"}}
    assert "do not show the bug on CPU" in search_module.upstream_test_line(quiet)


def test_when_the_census_triage_decides_a_row_by_hand_then_next_no_longer_ranks_it(tmp_path, monkeypatch):
    before = [row.pr for row, _ in triage.ranked()]
    assert before and 6979 not in before  # marked a duplicate of launcher-openmpi-premature-env-check
    first = before[0]
    marked = tmp_path / "census_triage.toml"
    marked.write_text(triage.CENSUS_TRIAGE.read_text() + f'\n[rows.{first}]\nstatus = "duplicate of"\nentry = "some-entry"\n')
    monkeypatch.setattr(triage, "CENSUS_TRIAGE", marked)
    assert [row.pr for row, _ in triage.ranked()] == before[1:]
