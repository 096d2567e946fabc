"""ci.triage on a tiny fake DeepSpeed: a git repository whose fix commits add tests, and two "releases" (one
without the fixes, one with them), each a directory with a ``deepspeed`` package."""
from __future__ import annotations

import json
import re
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest

from ci import triage

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
NEW_API = "\n\ndef subtract(a, b):\n    return a - b\n"

TESTS = {
    101: ("unit/test_add.py", "from deepspeed import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"),
    103: ("unit/test_passes.py", "def test_passes():\n    assert True\n"),
    104: ("unit/test_hangs.py", "import time\n\n\ndef test_hangs():\n    time.sleep(600)\n"),
    105: ("unit/test_dies.py", "import os\nimport signal\n\n\ndef test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n"),
    106: ("unit/test_gpu.py", "import pytest\n\n\ndef test_gpu():\n    pytest.skip('only supported in accelerator "
                              "environments (CUDA)')\n"),
    109: ("unit/test_new_api.py", "from deepspeed import add, subtract\n\n\ndef test_new_api():\n"
                                  "    assert subtract(3, 1) == 2\n"),
    110: ("unit/test_watchdog.py", "import time\nfrom deepspeed import add\n\n\ndef test_watchdog():\n"
                                   "    if add(1, 1) != 2:\n        time.sleep(600)  # a rank waiting forever\n"),
    108: ("unit/test_hangs_before.py", "import pytest\nfrom deepspeed import add\n\n\ndef test_hangs_before():\n"
                                      "    if add(1, 1) != 2:  # what upstream's launcher does when a rank never returns\n"
                                      "        pytest.exit('Test hanged, exiting', returncode=1)\n"),
    107: ("unit/test_cuda_call.py", "import torch\nfrom deepspeed import add\n\n\ndef test_cuda_call():\n"
                                    "    x = torch.ones(2).cuda()\n    assert add(x, x).sum().item() == 4\n"),
}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("fake")
    repo = root / "repo"
    (repo / "deepspeed").mkdir(parents=True)
    (repo / "tests" / "unit").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    (repo / "deepspeed" / "__init__.py").write_text(BUGGY)
    (repo / "tests" / "pytest.ini").write_text("[pytest]\naddopts = -m 'not sequential'\nmarkers =\n    sequential: x\n")
    (repo / "tests" / "unit" / "__init__.py").write_text("")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "start")
    shas = {}
    for pr in (101, 102, 103, 104, 105, 106, 107, 108, 109, 110):
        if pr == 101:
            (repo / "deepspeed" / "__init__.py").write_text(FIXED)
        elif pr == 109:  # the fix adds an API its test uses
            (repo / "deepspeed" / "__init__.py").write_text(FIXED + NEW_API)
        elif pr == 102:
            (repo / "deepspeed" / "other.py").write_text("X = 1\n")
        if pr in TESTS:
            path, text = TESTS[pr]
            (repo / "tests" / path).write_text(text)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-qm", f"Fix {pr} (#{pr})")
        shas[pr] = _git(repo, "rev-parse", "--short=9", "HEAD")
    releases = root / "releases"
    for release, text in (("0.1.0", BUGGY), ("0.2.0", FIXED + NEW_API)):
        (releases / release / "deepspeed").mkdir(parents=True)
        (releases / release / "deepspeed" / "__init__.py").write_text(text)
    machine = triage.Triage(triage.Clone(repo), ["0.1.0", "0.2.0"], lambda release: releases / release, timeout=25,
                            cache=root / "cache", clone_arg="REPO")
    return {"machine": machine, "shas": shas, "root": root}


def _row(fake: dict, pr: int, first: str | None = "0.2.0") -> triage.Row:
    return triage.Row(pr, fake["shas"][pr], first, "ZeRO-3", "silent-wrong", f"Fix {pr}", True)


def test_when_the_fix_commits_test_fails_before_and_passes_after_then_the_row_is_reproduced(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 101))
    assert outcome.state == triage.REPRODUCED, outcome
    assert (outcome.before, outcome.after) == ("0.1.0", "0.2.0")
    assert outcome.tests == ["unit/test_add.py::test_add"]
    before, after = outcome.runs
    assert (before.failed, before.passed, after.passed, after.failed) == (1, 0, 1, 0)
    assert "assert -1 == 5" in before.failures["unit/test_add.py::test_add"]
    assert outcome.command == "python -m ci.triage --ds-clone REPO --pr 101 --force"
    assert before.command == "python -m ci.triage --ds-clone REPO --pr 101 --release 0.1.0 --force"
    assert before.date and before.duration_s > 0


def test_when_the_commit_ships_no_test_then_the_row_says_no_upstream_test_without_running(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 102))
    assert outcome.state == triage.NO_TEST and outcome.runs == [] and "scripted reproduction is needed" in outcome.reason
    assert "(the fix changed deepspeed/other.py)" in outcome.reason  # where a reproduction would start


def test_when_the_test_passes_before_the_fix_then_it_is_not_detected_and_after_is_not_run(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 103))
    assert outcome.state == triage.NOT_DETECTED and [run.release for run in outcome.runs] == ["0.1.0"]


def test_when_a_test_hangs_then_its_child_is_killed_at_the_timeout_and_the_row_could_not_run(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 104))
    assert outcome.state == triage.COULD_NOT_RUN and "timed out on 0.1.0" in outcome.reason, outcome
    assert outcome.runs[0].timed_out and outcome.runs[0].duration_s < 60


def test_when_a_test_child_dies_then_the_row_could_not_run_and_says_how(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 105))
    assert outcome.state == triage.COULD_NOT_RUN and "exit -9" in outcome.reason, outcome


def test_when_every_test_skips_for_want_of_a_gpu_then_the_row_needs_an_accelerator(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 106))
    assert outcome.state == triage.ACCELERATOR and "accelerator environments" in outcome.reason, outcome


def test_when_a_test_calls_cuda_then_the_cpu_edit_fires_and_is_recorded(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 107))
    assert outcome.state == triage.REPRODUCED, outcome  # ones(2) - ones(2) sums to 0 before, 4 after
    assert "tensor.cuda() -> CPU" in outcome.runs[0].edits and "tensor.cuda() -> CPU" in outcome.runs[1].edits
    assert not any("cuda" in edit for edit in fake["machine"].triage(_row(fake, 101)).runs[0].edits)


def test_when_a_test_hangs_before_the_fix_and_passes_with_it_then_the_hang_is_its_failure(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 108))
    assert outcome.state == triage.REPRODUCED, outcome
    assert outcome.runs[0].failures == {"unit/test_hangs_before.py::test_hangs_before": triage.HUNG}


def test_when_the_test_fails_before_only_for_lack_of_what_the_fix_adds_then_it_reproduces_nothing(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 109))
    assert outcome.state == triage.COULD_NOT_RUN, outcome
    assert "uses what the fix adds (subtract)" in outcome.reason and outcome.tests == ["unit/test_new_api.py::test_new_api"]


def test_when_a_rank_hangs_past_the_hang_limit_then_the_watchdog_records_it_and_ends_the_run(fake: dict) -> None:
    import dataclasses

    quick = dataclasses.replace(fake["machine"], hang=3.0)
    outcome = quick.triage(_row(fake, 110))
    assert outcome.state == triage.REPRODUCED, outcome  # hangs before the fix, passes with it
    before = outcome.runs[0]
    assert before.failures == {"unit/test_watchdog.py::test_watchdog": triage.HUNG} and not before.timed_out
    assert before.duration_s < 20  # ended by the watchdog, not the 25 s run timeout


def test_when_the_census_names_no_release_then_the_first_release_with_the_fix_is_read_from_the_source(fake: dict) -> None:
    outcome = fake["machine"].triage(_row(fake, 101, first=None))
    assert (outcome.before, outcome.after, outcome.state) == ("0.1.0", "0.2.0", triage.REPRODUCED)


def test_when_a_row_is_recorded_then_check_passes_and_a_missing_command_or_row_fails_it(fake: dict) -> None:
    rows = [_row(fake, 101), _row(fake, 102)]
    data = {"rows": {}, "entries": {}, "sessions": []}
    triage.run_rows(fake["machine"], rows[:1], data, jobs=1, save_to=None)
    problems = triage.check(data, rows)
    assert problems == [f"row 102 (ZeRO-3, Fix 102): no recorded outcome"], problems
    triage.run_rows(fake["machine"], rows[1:], data, jobs=1, save_to=None)
    assert triage.check(data, rows) == []
    data["rows"]["101"]["runs"][0]["date"] = ""
    assert triage.check(data, rows) == ["row 101: the run on 0.1.0 lacks its command or date"]
    assert data["sessions"][0]["rows"] == 1 and data["sessions"][0]["rows_per_hour"] > 0


def test_when_a_row_is_recorded_then_a_second_pass_reuses_its_runs_unless_forced(fake: dict, tmp_path: Path) -> None:
    row = _row(fake, 101)
    data = {"rows": {}, "entries": {}, "sessions": []}
    first = triage.run_rows(fake["machine"], [row], data, jobs=1, save_to=tmp_path / "t.json")[0]
    again = fake["machine"].triage(row, triage.Outcome.from_json(json.loads((tmp_path / "t.json").read_text())["rows"]["101"]))
    assert [asdict(run) for run in again.runs] == [asdict(run) for run in first.runs]  # not run again
    forced = triage.run_rows(fake["machine"], [row], data, jobs=1, force=True, save_to=None)[0]
    assert forced.runs[0].date == first.runs[0].date and forced.runs[0] is not first.runs[0]


def test_when_a_commit_changes_lines_inside_one_test_then_only_that_test_is_selected() -> None:
    source = ("import pytest\n\n\nclass TestA:\n    world_size = 2\n\n    def test_one(self):\n        assert 1\n\n"
              "    @pytest.mark.parametrize('x', [1, 2])\n    def test_two(self, x):\n        assert x\n\n\n"
              "def helper():\n    return 1\n\n\ndef test_three():\n    assert helper()\n")
    assert triage.select_tests(source, "tests/unit/t.py", {11})[0] == ["unit/t.py::TestA::test_two"]
    assert triage.select_tests(source, "tests/unit/t.py", {10})[0] == ["unit/t.py::TestA::test_two"]  # its decorator
    assert triage.select_tests(source, "tests/unit/t.py", {5})[0] == ["unit/t.py::TestA::test_one",
                                                                      "unit/t.py::TestA::test_two"]  # the class
    chosen, how = triage.select_tests(source, "tests/unit/t.py", {16})
    assert len(chosen) == 3 and "helpers only" in how
    assert len(triage.select_tests(source, "tests/unit/t.py", None)[0]) == 3


def test_when_the_clone_is_not_a_repository_then_the_error_says_what_is_needed(tmp_path: Path) -> None:
    with pytest.raises(triage.TriageError, match="is not a git repository"):
        triage.Clone(tmp_path)


def test_when_the_fix_commit_is_not_in_the_clone_then_the_reason_dates_the_clone_without_its_path(fake: dict) -> None:
    row = triage.Row(999, "", None, "ZeRO-3", "crash", "Fix 999", True)
    with pytest.raises(triage.TriageError) as raised:
        fake["machine"].clone.commit(row)
    message = str(raised.value)
    assert message.startswith("the fix commit of PR #999 is not in the DeepSpeed clone given (--ds-clone; its newest "
                              "commit: "), message
    assert message.endswith("Fix 110 (#110))") and str(fake["root"]) not in message, message


def test_the_committed_record_covers_every_backlog_row_with_command_and_date() -> None:
    assert triage.check() == []


def test_when_two_triages_record_side_by_side_then_neither_loses_the_others_rows(tmp_path: Path) -> None:
    path = tmp_path / "triage.json"
    first, second = triage.load(path), triage.load(path)  # both read the record before either writes
    first["rows"]["1"], second["rows"]["2"] = {"key": "1"}, {"key": "2"}
    triage.save(first, path, rows=["1"])
    triage.save(second, path, rows=["2"], session={"rows": 1})
    kept = json.loads(path.read_text())
    assert set(kept["rows"]) == {"1", "2"} and kept["sessions"] == [{"rows": 1}]


def test_when_a_killed_build_left_its_lock_then_it_is_cleared_and_a_fresh_one_is_kept(tmp_path: Path) -> None:
    import os
    import time

    (tmp_path / "fused_adam").mkdir()
    (tmp_path / "cpu_adam").mkdir()
    old, fresh = tmp_path / "fused_adam" / "lock", tmp_path / "cpu_adam" / "lock"
    old.touch()
    fresh.touch()
    os.utime(old, (time.time() - 2 * triage.STALE_LOCK_S,) * 2)
    assert triage.clear_stale_build_locks(tmp_path) == [old]
    assert not old.exists() and fresh.exists()  # a build in progress keeps its lock


def test_when_an_error_names_this_machines_paths_then_the_record_keeps_them_relative() -> None:
    from ci import triage as triage_module

    text = ("ERROR: found no collectors for /home/u/fixbook/.cache/triage/2e7f8e580e70/tests/unit/a.py::T | "
            "(/home/u/fixbook/.deepspeed/0.19.0/deepspeed/runtime/zero/parameter_offload.py)")
    assert triage_module.portable(text) == ("ERROR: found no collectors for tests/unit/a.py::T | "
                                            "(site-packages/deepspeed/runtime/zero/parameter_offload.py)")
    built = "ImportError: /home/u/fixbook/.cache/torch_extensions/0.18.9/cpu_adam/cpu_adam.so: cannot open shared object"
    assert triage_module.portable(built) == ("ImportError: torch_extensions/0.18.9/cpu_adam/cpu_adam.so: cannot open "
                                             "shared object")
    assert "/home/u" not in triage_module.DATA.read_text()
    machine_paths = re.findall(r"(?<![\w.])/(?:home|work|tmp|root|Users|mnt|opt)/[^\s\"']*", triage_module.DATA.read_text())
    assert not machine_paths, machine_paths[:5]
    assert "/.cache/triage/" not in triage_module.DATA.read_text()


# ---- the entries' runs: errors apart from failures, the proof in every rank, the pinned pytest -----------------

def _run(release: str = "0.1.0", *, passed: int = 0, failed: int = 0, errors: int = 0, skipped: int = 0,
         applied: str = "", processes: list | None = None) -> triage.ReleaseRun:
    failures = {f"unit/t.py::test_{i}": "AssertionError: wrong" for i in range(failed)}
    failures.update({f"unit/t.py::test_e{i}": "fixture 'baseline_ws2' not found" for i in range(errors)})
    return triage.ReleaseRun(release, ["unit/t.py::test"], passed=passed, failed=failed, errors=errors,
                             skipped=skipped, failures=failures, failing=list(failures), applied=applied,
                             processes=processes or [])


def _held(*ranks: tuple[int, int], missing: tuple[int, ...] = ()) -> list[dict]:
    """The pytest process's line and one per (rank, world size), each holding the fix unless its rank is missing."""
    lines = [{"pid": 1, "rank": "pytest", "world_size": None, "applied": ["e"], "missing": []}]
    for number, (rank, world) in enumerate(ranks, 2):
        lines.append({"pid": number, "rank": rank, "world_size": world,
                      "applied": [] if rank in missing else ["e"], "missing": ["e"] if rank in missing else []})
    return lines


def test_when_no_test_ran_without_or_with_the_fix_then_the_verdict_is_could_not_run_never_still_fails() -> None:
    errors_only = _run(errors=144)
    verdict, reason = triage.entry_verdict(errors_only, _run(errors=144, applied="e", processes=_held()), "e")
    assert verdict == triage.DID_NOT_RUN and "144 errors" in reason and "baseline_ws2" in reason
    verdict, reason = triage.entry_verdict(_run(failed=2), _run(errors=3, applied="e", processes=_held()), "e")
    assert verdict == triage.DID_NOT_RUN and reason.startswith("with the fix no test ran")
    skipped_only = _run(skipped=4)
    assert triage.entry_verdict(skipped_only, skipped_only, "e")[0] == triage.DID_NOT_RUN


def test_when_failures_remain_with_the_fix_then_it_still_fails_and_the_reason_names_them() -> None:
    verdict, reason = triage.entry_verdict(_run(failed=3), _run(passed=2, failed=1, applied="e",
                                                                  processes=_held((0, 2), (1, 2))), "e")
    assert verdict == triage.STILL_FAILS and "test_0: AssertionError: wrong" in reason
    verdict, _ = triage.entry_verdict(_run(failed=3), _run(passed=3, applied="e", processes=_held((0, 2), (1, 2))), "e")
    assert verdict == triage.FIX_PASSES
    verdict, _ = triage.entry_verdict(_run(failed=3), _run(passed=3, errors=1, applied="e", processes=_held()), "e")
    assert verdict == triage.PASSES_WHERE_RAN  # an error is no failure, and no pass either


def test_when_a_rank_did_not_hold_the_fix_then_the_run_with_it_does_not_count() -> None:
    proven, proof = triage.fix_proof(_run(passed=3, applied="e", processes=_held((0, 2), (1, 2))), "e")
    assert proven and "all 2 rank processes" in proof
    lacking = _run(passed=3, applied="e", processes=_held((0, 2), (1, 2), missing=(1,)))
    proven, proof = triage.fix_proof(lacking, "e")
    assert not proven and "rank 1 of 2" in proof
    verdict, reason = triage.entry_verdict(_run(failed=3), lacking, "e")
    assert verdict == triage.NOT_PROVEN and "rank 1 of 2" in reason
    silent = _run(passed=3, applied="e", processes=_held((0, 2), (1, 2), (0, 2)))  # a rank 1 wrote nothing
    assert not triage.fix_proof(silent, "e")[0]
    assert not triage.fix_proof(_run(passed=3, applied="e"), "e")[0]  # no record at all proves nothing


def test_when_several_fixes_are_applied_together_then_every_process_must_hold_each() -> None:
    both = _held((0, 2), (1, 2))
    for line in both:
        line["applied"] = ["e", "f"]
    assert triage.fix_ids("e,f") == ["e", "f"] and triage.fix_ids("") == []
    assert triage.fix_proof(_run(passed=3, applied="e,f", processes=both), "e,f")[0]
    one_short = [dict(line) for line in both]
    one_short[2] = {**one_short[2], "applied": ["e"]}  # rank 0 held only the entry's own fix
    proven, proof = triage.fix_proof(_run(passed=3, applied="e,f", processes=one_short), "e,f")
    assert not proven and "1 of 3 processes did not hold the fix" in proof


def test_when_the_scope_file_names_a_pr_then_its_cases_are_left_out_with_why(tmp_path: Path) -> None:
    scope = tmp_path / "scope.toml"
    scope.write_text('[7665]\nleave_out = ["unit/a.py::T::test"]\nwhy = """they assert\nanother change"""\n'
                     '[1]\nleave_out = ["unit/b.py::test"]\n')
    assert triage.scope(7665, scope) == ({"unit/a.py::T::test"}, "they assert another change")
    assert triage.scope(2, scope) == (set(), "") and triage.scope(None, scope) == (set(), "")
    with pytest.raises(triage.TriageError, match="PR 1 must give leave_out"):
        triage.scope(1, scope)  # a case left out without a reason is refused
    left_out, why = triage.scope(7665)  # the committed file: every case it names has a reason
    assert all("::" in case for case in left_out) and why


def test_when_a_rank_joins_a_process_group_then_it_records_whether_it_holds_the_fix(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "unit" / "test_rank.py").write_text(
        "import multiprocessing as mp\nimport os\n\n\ndef _rank(port):\n    import torch.distributed as dist\n"
        "    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1)\n"
        "    dist.destroy_process_group()\n\n\ndef test_rank():\n    import socket\n    with socket.socket() as s:\n"
        "        s.bind(('127.0.0.1', 0))\n        port = s.getsockname()[1]\n"
        "    child = mp.get_context('spawn').Process(target=_rank, args=(port,))\n    child.start()\n"
        "    child.join(120)\n    assert child.exitcode == 0\n")
    release = tmp_path / "release"
    (release / "deepspeed").mkdir(parents=True)
    (release / "deepspeed" / "__init__.py").write_text("__version__ = '0.0.1'\n")
    # The id names no registered fix: every process tries to apply it and none can, as a rank without the fix
    run = triage.run_tests(tests, ["unit/test_rank.py::test_rank"], "0.0.1", release, timeout=150,
                           apply="no-such-fix")
    assert run.passed == 1, run
    ranks = [line for line in run.processes if line["rank"] == 0]
    assert [line["world_size"] for line in ranks] == [1] and ranks[0]["missing"] == ["no-such-fix"]
    assert any(line["rank"] == "pytest" for line in run.processes)
    assert triage.fix_proof(run, "no-such-fix") == (False, triage.fix_proof(run, "no-such-fix")[1])
    assert "did not hold the fix" in triage.fix_proof(run, "no-such-fix")[1]


def test_when_deepspeed_pins_pytest_below_this_ones_then_a_pinned_one_is_chosen() -> None:
    requirements = "clang-format==18.1.3\npytest>=7.2.0,<8.4.0\npytest-forked\npytest-randomly\n"
    assert triage.pytest_pin(requirements) == ">=7.2.0,<8.4.0"  # pytest-forked is another package
    assert triage.pytest_pin("pytest\n") == "" and triage.pytest_pin("torch\n") == ""
    assert triage.choose_pytest(">=7.2.0,<8.4.0", "9.2.0") == "8.3.5"
    assert triage.choose_pytest(">=7.2.0,<8.4.0", "8.3.2") is None  # this Python's satisfies it: used as it is
    assert triage.choose_pytest(">=7.2.0", "9.2.0") is None
    assert triage.choose_pytest("<8.0", "9.2.0") == "7.4.4"
    with pytest.raises(triage.TriageError, match="pin pytest<7"):
        triage.choose_pytest("<7", "9.2.0")


def test_when_an_entry_record_is_missing_or_still_fails_without_a_reason_then_check_says_so() -> None:
    still = {"entry": "e", "pr": 1, "verdict": triage.STILL_FAILS, "reason": "",
             "with": {"passed": 0, "failed": 0, "errors": 9}}
    problems = triage.check_entries({"entries": {"e#1": still}}, cited={"e": (1, 2)})
    assert triage.unmeasured_entries({"entries": {"e#1": still}}, cited={"e": (1, 2)}) == [
        "entry e: PR #2's upstream test has no record yet (python -m ci.triage --ds-clone PATH --entries --entry e)"]
    assert any("gives no reason" in p for p in problems) and any("where no test ran" in p for p in problems)
    fine = dict(still, reason="test_x: AssertionError", **{"with": {"passed": 1, "failed": 1, "errors": 0}})
    assert triage.check_entries({"entries": {"e#1": fine}}, cited={"e": (1,)}) == []


def test_when_the_test_fails_with_the_fix_for_an_api_the_release_lacks_then_the_reason_names_that_api() -> None:
    with_ = _run(passed=1, failed=1, applied="e", processes=_held())
    with_.failures = {"unit/t.py::test_0": "TypeError: __init__() got an unexpected keyword argument 'warmup_min_ratio'"}
    verdict, reason = triage.entry_verdict(_run(failed=2), with_, "e")
    assert verdict == triage.STILL_FAILS and "an API DeepSpeed 0.1.0 lacks (warmup_min_ratio)" in reason


def test_when_recorded_entries_are_reclassified_then_no_run_without_results_stays_still_failing(tmp_path: Path) -> None:
    nothing = asdict(_run(errors=144))
    legacy = dict(asdict(_run(passed=1, failed=1, applied="e")), fix_log=["fix: e: applied"])
    data = {"rows": {}, "sessions": [], "entries": {
        "e#1": {"entry": "e", "pr": 1, "verdict": triage.STILL_FAILS, "without": nothing, "with": nothing},
        "e#2": {"entry": "e", "pr": 2, "verdict": triage.STILL_FAILS, "without": asdict(_run(failed=2)),
                "with": legacy}}}
    triage.reclassify_entries(data, save_to=tmp_path / "triage.json")
    saved = json.loads((tmp_path / "triage.json").read_text())["entries"]
    assert saved["e#1"]["verdict"] == triage.DID_NOT_RUN and "144 errors" in saved["e#1"]["reason"]
    assert saved["e#2"]["verdict"] == triage.NOT_PROVEN and "predates" in saved["e#2"]["reason"]


def test_when_one_file_passes_with_the_fix_and_another_fails_then_the_reason_tells_them_apart() -> None:
    without = _run(failed=2)
    without.failing = ["unit/a.py::test_x", "unit/b.py::test_y"]
    with_ = _run(passed=1, failed=1, applied="e", processes=_held())
    with_.failing, with_.passing = ["unit/b.py::test_y"], ["unit/a.py::test_x"]
    with_.failures = {"unit/b.py::test_y": "AssertionError: dtype"}
    verdict, reason = triage.entry_verdict(without, with_, "e")
    assert verdict == triage.STILL_FAILS
    assert "unit/a.py: 1 failing without the fix, 0 with it (1 passing): the fix makes it pass" in reason
    assert "unit/b.py: 1 failing without the fix, 1 with it (0 passing): still fails with the fix" in reason


def test_when_the_fix_is_first_released_in_the_oldest_release_run_or_before_then_the_row_says_why_it_cannot_run(
        fake: dict) -> None:
    repo = fake["machine"].clone.path
    _git(repo, "tag", "v0.0.9", "HEAD~9")  # a release tag older than the oldest release the machine runs
    try:
        outcome = fake["machine"].triage(_row(fake, 101, first="0.1.0"))
    finally:
        _git(repo, "tag", "-d", "v0.0.9")
    assert (outcome.state, outcome.runs, outcome.after) == (triage.COULD_NOT_RUN, [], "0.1.0")
    assert outcome.reason.startswith("first released in 0.1.0: the last release without the fix (0.0.9) is older "
                                     "than 0.1.0, the oldest release the triage runs"), outcome.reason
    assert outcome.tests == ["unit/test_add.py::test_add"]  # what would run, recorded


def test_when_a_test_module_skips_itself_whole_then_the_run_reads_its_reason_not_a_crash():
    output = ("\x1b[33mSKIPPED\x1b[0m [1] unit/ops/muon/test_muon.py:14: fp16 not supported, valid dtype: [torch.float32]\n"
              "\x1b[33m==== 1 skipped in 5.80s ====\x1b[0m\n"
              "ERROR: found no collectors for tests/unit/ops/muon/test_muon.py::TestMuon::test_x\n")
    assert triage.skipped_modules(output) == [(1, "fp16 not supported, valid dtype: [torch.float32]")]
    assert triage.ACCELERATOR_WORDS.search("fp16 not supported, valid dtype") is not None
    run = triage.ReleaseRun("0.1.0", ["t.py::test"], skipped=1, skips=["fp16 not supported, valid dtype: [torch.float32]"])
    state, reason, _ = triage.classify(run, None)
    assert state == triage.ACCELERATOR and "fp16 not supported" in reason


class _Files:
    """A clone that only shows files: {path: text}."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files

    def show(self, commit: str, path: str, missing_ok: bool = False) -> str:
        return self.files.get(path, "")


def test_when_the_commits_tests_mark_fixtures_the_old_way_then_a_backlog_run_takes_a_pytest_before_8_4(tmp_path):
    machine = triage.Triage(_Files({"tests/unit/common.py": "_pytestfixturefunction = FixtureFunctionMarker(...)",
                                    "requirements/requirements-dev.txt": "pytest>=7.2.0\n"}),
                            ["0.1.0"], lambda release: tmp_path, cache=tmp_path)
    installed = []
    original = triage.install_pytest
    triage.install_pytest = lambda version, cache: installed.append(version) or tmp_path / version
    try:
        choice = machine.pytest_for("abc")
    finally:
        triage.install_pytest = original
    current = triage._pytest_version()
    from packaging.version import Version

    expected = current if Version(current) < Version("8.4") else "8.3.5"
    assert choice is not None and choice.version == expected and choice.pin == ">=7.2.0,<8.4"
    plain = triage.Triage(_Files({"tests/unit/common.py": "class DistributedTest: ...\n"}), ["0.1.0"],
                          lambda release: tmp_path, cache=tmp_path)
    assert plain.pytest_for("abc") is None  # a backlog row keeps this Python's pytest


def test_when_a_run_hangs_then_the_stacks_say_where_each_process_waited(tmp_path):
    dump = ('Timeout (0:01:00)!\nThread 0x00007f (most recent call first):\n'
            '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 10 in all_reduce\n'
            '  File "/x/.deepspeed/0.18.3/deepspeed/comm/torch.py", line 20 in all_reduce\n'
            '  File "/x/tests/unit/v1/zero/test_z.py", line 30 in test\n')
    (tmp_path / "11.txt").write_text("Timeout (0:01:00)!\nThread 0x00007f (most recent call first):\n"
                                     '  File "/usr/lib/python3.11/threading.py", line 1 in wait\n' + dump)
    (tmp_path / "12.txt").write_text(dump)
    (tmp_path / "13.txt").write_text("")  # a process that never waited a whole interval
    (tmp_path / "14.txt").write_text('Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n'
                                     '  File "/x/deepspeed/ops/op.py", line 5 in run\n')
    assert triage.hang_stacks(tmp_path) == [
        "a process died: Segmentation fault",
        "torch/distributed/distributed_c10d.py:10 in all_reduce <- deepspeed/comm/torch.py:20 in all_reduce",
        "1 processes wrote no stack: they ended before the first dump"]
    pool = "multiprocessing/pool.py:765 in wait <- multiprocessing/pool.py:768 in get"
    rank = "torch/distributed/distributed_c10d.py:5356 in barrier <- torch/distributed/c10d_logger.py:83 in wrapper"
    assert triage.waiting_point([pool, rank]) == rank and triage.waiting_point([pool]) == pool
    assert triage.waiting_point([]) == ""
