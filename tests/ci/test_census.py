"""The upstream census as data: built from the TSV, every row checked or saying why not; the second tier of search."""
import csv
import json

from ci import census
from fixes import search as search_module
from fixes.cli import main

from ci import triage

STATUSES = {"entry", "planned", "does not reproduce here", "duplicate of", "not tried", *triage.STATES}
LR_TRACEBACK = """Traceback (most recent call last):
  File "/home/user/train.py", line 51, in <module>
    lr_scheduler.step()
  File "/usr/local/lib/python3.11/site-packages/deepspeed/runtime/lr_schedules.py", line 864, in get_lr
    lr_ratio = self.get_lr_ratio()
  File "/usr/local/lib/python3.11/site-packages/deepspeed/runtime/lr_schedules.py", line 850, in get_lr_ratio
    ratio = (1 + math.cos(math.pi * real_last_step / real_total_steps)) / 2
ZeroDivisionError: float division by zero

my config: "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 10}}"""


def test_when_the_data_is_built_from_the_tsv_then_every_row_is_there_checked_or_saying_why_not():
    with census.SOURCE.open() as handle:
        source = list(csv.DictReader(handle, delimiter="\t"))
    data = census.build()
    assert len(data["rows"]) == len(source)
    for row in data["rows"]:
        assert row["check"]["status"] in ("measured", "unchecked") and row["check"]["how"], row["pr"]
    backlog = [r for r in data["rows"] if "triage" in r]
    assert len(backlog) == sum(1 for r in source if r["user_visible"] == "yes" and r["cpu_reproducible"] == "likely")
    assert all(r["triage"]["status"] in STATUSES for r in backlog)
    assert any(r["triage"]["status"] == "entry" for r in backlog)
    assert census.main(["--check"]) == 0, "fixes/data/upstream_fixes.json is stale: python -m ci.census"


def test_when_an_error_names_a_known_upstream_fix_then_it_is_listed_in_the_second_tier():
    [found] = [m for m in search_module.upstream(LR_TRACEBACK, "0.18.9") if m.pr == 8142]
    assert "WarmupCosineLR" in found.named and found.first_release == "0.19.3"
    assert "predates this fix" in found.release_note


def test_when_the_cli_answers_then_the_second_tier_comes_after_every_proven_entry(capsys):
    text = LR_TRACEBACK + "\nRuntimeError: Output 0 of SplitBackward0 is a view and is being modified inplace"
    assert main(["search", text, "--release", "0.18.9"]) == 0
    out = capsys.readouterr().out
    assert out.index("zero12-flat-buffer-detach") < out.index("Known upstream fixes") < out.index("PR #8142")
    assert "no entry: no notebook proof, no fix module" in out


def test_when_upstreams_test_reproduced_a_row_then_the_second_tier_and_doctor_say_so(monkeypatch, capsys):
    rows = [dict(r) for r in search_module.upstream_rows()]
    [row] = [r for r in rows if r["pr"] == 8142]
    row["upstream_test"] = {"state": triage.REPRODUCED, "before": "0.19.2", "after": "0.19.3", "reason": "r"}
    monkeypatch.setattr(search_module, "upstream_rows", lambda: (row,))
    [found] = [m for m in search_module.upstream(LR_TRACEBACK, "0.18.9") if m.pr == 8142]
    assert found.upstream_test == "reproduced by upstream's test on CPU (0.19.2 fails, 0.19.3 passes) — no entry yet"
    assert main(["search", LR_TRACEBACK, "--release", "0.18.9"]) == 0
    assert "reproduced by upstream's test on CPU (0.19.2 fails, 0.19.3 passes)" in capsys.readouterr().out
    assert search_module.upstream_reproduced_lacking("0.18.9") == {row["component"]: 1}
    assert search_module.upstream_reproduced_lacking("0.19.3") == {}


def test_when_an_unrelated_error_is_searched_then_no_known_upstream_fix_is_offered_either():
    queries = json.loads((census.ROOT / "tests/fixes/data/search_queries.json").read_text())
    offered = {q["name"]: [m.pr for m in search_module.upstream(q["query"])] for q in queries if not q["expect"]}
    assert not any(offered.values()), offered
