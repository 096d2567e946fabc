"""ci.bench.clean_machine: the README's commands it times, and the page section its records make."""
import os
from pathlib import Path

import pytest

from ci.bench import clean_machine


def test_when_the_readme_is_read_then_the_commands_are_its_first_two_bash_blocks() -> None:
    commands = clean_machine.readme_commands()
    assert commands["main"].startswith("bash ci/setup.sh notebooks")
    assert commands["tests"] in (Path(__file__).parents[3] / ".ci" / "run").read_text().splitlines()


def test_when_a_readme_lacks_a_block_then_a_clear_error(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```bash\nbash ci/setup.sh\n```\n")
    with pytest.raises(ValueError, match="1 bash block"):
        clean_machine.readme_commands(readme)


def test_when_a_mode_is_unknown_then_nothing_is_cloned() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        clean_machine.measure("everything")


def test_when_the_clean_environment_is_made_then_every_cache_is_new_and_nothing_selects_the_checkouts_venv(
        tmp_path: Path) -> None:
    inherited = {"PATH": "/usr/bin", "VIRTUAL_ENV": "/x/.venv", "PYTHONPATH": "/x", "FIXBOOK_BUILD": "/x/build",
                 "UV_CACHE_DIR": "/x/uv", "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_root", "TRITON_HOME": "/x"}
    env = clean_machine.clean_environment(tmp_path / "caches", inherited)
    assert env["PATH"] == "/usr/bin"
    assert not {"VIRTUAL_ENV", "PYTHONPATH", "FIXBOOK_BUILD", "TRITON_HOME"} & set(env)
    caches = ("PIP_CACHE_DIR", "UV_CACHE_DIR", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    assert all(Path(env[name]).parent == tmp_path / "caches" for name in caches)  # torch.compile's builds too
    assert len({env[name] for name in caches}) == len(caches)


def test_when_records_exist_then_the_page_gives_each_command_its_time_exit_and_load() -> None:
    record = {"command": "bash ci/setup.sh && .venv/bin/python -m pytest", "seconds": 1234.5, "exit": 0,
              "commit": "abc1234", "date": "2026-01-02", "cpus": 2, "load_start": 1.5, "load_mean": None}
    text = "\n".join(clean_machine.page_lines({"tests": record}))
    assert ("| Tests: `bash ci/setup.sh && .venv/bin/python -m pytest` | 20 min 34 s (1234.5 s) | not recorded | 0 | "
            "abc1234 | 2026-01-02 | 2 | pip, uv, user |") in text  # a record from before torch.compile's cache was emptied
    text = "\n".join(clean_machine.page_lines({"tests": {**record, "caches": list(clean_machine.CACHES)}}))
    assert "| 2 | pip, uv, user, torch.compile |" in text
    assert "not sampled" in text and "Main job" not in text


def test_when_the_output_has_each_phases_last_line_then_each_phase_gets_its_seconds() -> None:
    lines = [(3.0, "ci/setup.sh notebooks: what the main job needs"), (120.5, "fresh set-up (notebooks) took 2 min 0 s"),
             (130.0, "[1/146] a on DeepSpeed 0.19.8: passed in 4 s"), (600.0, "146 passed, 0 failed"),
             (612.0, "site built in site/")]
    assert clean_machine.phase_seconds("main", lines, 615.0) == {"set-up": 120.5, "notebooks": 479.5, "site": 15.0}
    record = {"command": "c", "seconds": 615.0, "exit": 0, "commit": "abc1234", "date": "2026-01-02", "cpus": 2,
              "load_start": 0.1, "load_mean": 2.0, "phases": {"set-up": 120.5, "notebooks": 479.5, "site": 15.0}}
    assert "| set-up 120.5 s, notebooks 479.5 s, site 15.0 s |" in "\n".join(clean_machine.page_lines({"main": record}))


def test_when_a_phases_last_line_never_came_then_it_and_those_after_it_are_left_out() -> None:
    lines = [(120.5, "fresh set-up (all) took 2 min 0 s"), (900.0, "1 failed, 10 passed")]
    assert clean_machine.phase_seconds("tests", lines, 1000.0) == {"set-up": 120.5, "pytest": 879.5}
    assert clean_machine.phase_seconds("main", [(50.0, "error: no network")], 60.0) == {}


def _run(seconds: float, exit_status: int = 0) -> dict:
    return {"command": "c", "seconds": seconds, "exit": exit_status, "commit": "abc1234", "date": "2026-01-02",
            "cpus": 2, "load_start": 0.5, "load_mean": 3.0, "last_lines": ["done"]}


def test_when_a_run_is_added_then_it_is_the_latest_and_every_earlier_run_is_kept() -> None:
    clean: dict = {}
    clean_machine.add_record(clean, "tests", _run(1600.0))
    clean_machine.add_record(clean, "tests", _run(1400.0))
    clean_machine.add_record(clean, "main", _run(400.0))
    assert clean["tests"]["seconds"] == 1400.0 and clean["main"]["seconds"] == 400.0
    assert [(r["mode"], r["seconds"]) for r in clean["runs"]] == [("tests", 1600.0), ("tests", 1400.0), ("main", 400.0)]
    assert "last_lines" not in clean["runs"][0]


def test_when_runs_are_recorded_then_the_page_lists_each_and_counts_those_within_the_target() -> None:
    clean: dict = {}
    for mode, run in [("main", _run(350.0)), ("main", _run(500.0)), ("tests", _run(1100.0, exit_status=1)),
                      ("tests", _run(1150.0))]:
        clean_machine.add_record(clean, mode, run)
    text = "\n".join(clean_machine.page_lines(clean))
    assert "main job: 1 of 2 within 6 min 0 s; tests: 1 of 2 within 20 min 0 s" in text  # a failed run is not within
    assert "| Main job | 8 min 20 s (500.0 s) | no | 0 |" in text
    assert "| Tests | 18 min 20 s (1100.0 s) | no | 1 |" in text
    assert "| Tests | 19 min 10 s (1150.0 s) | yes | 0 |" in text


def test_when_proc_stat_is_read_twice_then_the_busy_share_and_stolen_time_are_the_difference(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3\n")
    before = clean_machine.cpu_times(stat)
    stat.write_text("cpu  250 0 100 850 50 0 0 50 0 0\n")  # +200 busy, +50 idle, +50 stolen ticks
    used = clean_machine.cpu_use(before, clean_machine.cpu_times(stat))
    assert used == {"cpu_busy": round(200 / 300, 3), "steal_s": round(50 / os.sysconf("SC_CLK_TCK"), 1)}
    assert clean_machine.cpu_times(tmp_path / "absent") == {} and clean_machine.cpu_use({}, before) == {}


def test_when_root_empties_the_file_cache_then_sync_and_3_are_written(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "drop_caches"
    synced: list[bool] = []
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "sync", lambda: synced.append(True))
    assert clean_machine.drop_file_cache(control) == "emptied"
    assert control.read_text() == "3\n" and synced == [True]


def test_when_not_root_then_the_file_cache_is_kept_and_the_record_says_so(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    control = tmp_path / "drop_caches"
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert clean_machine.drop_file_cache(control) == "kept: not root"
    assert not control.exists()


def test_when_the_control_file_cannot_be_written_then_the_cache_is_said_kept(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(os, "sync", lambda: None)
    state = clean_machine.drop_file_cache(tmp_path / "missing" / "drop_caches")
    assert state.startswith("kept: ") and "could not be written" in state


def test_when_vmstat_is_read_then_pgpgin_is_bytes_read_from_disk(tmp_path: Path) -> None:
    vmstat = tmp_path / "vmstat"
    vmstat.write_text("nr_free_pages 100\npgpgin 2048\npgpgout 7\n")
    assert clean_machine.disk_read_bytes(vmstat) == 2048 * 1024
    assert clean_machine.disk_read_bytes(tmp_path / "absent") is None


def test_when_a_run_records_its_file_cache_then_the_page_shows_it_and_older_runs_say_not_recorded() -> None:
    base = {"command": "bash ci/setup.sh", "seconds": 300.0, "exit": 0, "commit": "abc", "date": "2026-12-06",
            "cpus": 2, "load_start": 0.1, "load_mean": 1.0, "caches": ["pip"]}
    new = {**base, "mode": "main", "file_cache": "emptied", "disk_read_mib": 812}
    old = {**base, "mode": "main"}
    text = "\n".join(clean_machine.page_lines({"main": new, "runs": [old, new]}))
    assert "emptied; 812 MiB read from disk" in text
    assert "| not recorded |" in text


def test_when_a_run_records_the_reference_loop_then_the_page_gives_both_timings_and_older_runs_none() -> None:
    base = {"command": "bash ci/setup.sh", "seconds": 300.0, "exit": 0, "commit": "abc", "date": "2026-12-07",
            "cpus": 2, "load_start": 0.1, "load_mean": 1.0, "caches": ["pip"], "mode": "main", "cpu_busy": 0.9,
            "steal_s": 1.5}
    new = {**base, "reference_loop_s": [1.333, 1.944]}
    text = "\n".join(clean_machine.page_lines({"main": new, "runs": [base, new]}))
    assert "90% busy, 1.5 s stolen; reference loop 1.333 s at the start, 1.944 s at the end" in text
    assert "90% busy, 1.5 s stolen |" in text  # the older run, which kept no reference loop


def test_when_the_reference_loop_runs_then_its_seconds_are_the_clocks_difference_around_it(monkeypatch) -> None:
    readings = iter([100.0, 101.23456])  # the clock read before and after the loop: no real timing in the test
    monkeypatch.setattr(clean_machine.time, "perf_counter", lambda: next(readings))
    assert clean_machine.reference_loop_seconds(1000) == 1.235
    assert next(readings, None) is None  # read exactly twice
