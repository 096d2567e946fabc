"""ci/setup.sh: its modes, and the plan it prints before it starts (ci/releases/setup_plan.py)."""
import json
import tomllib
import subprocess

from ci import ROOT
from ci.releases import setup_plan


def test_when_setup_gets_an_unknown_scope_then_it_exits_2_naming_the_scopes_and_installs_nothing(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "ci" / "setup.sh"), "everything"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "usage: bash ci/setup.sh [MODE]" in done.stderr and "unknown mode: everything" in done.stderr
    assert "disk before set-up" not in done.stdout and "It will make" not in done.stdout


def test_when_setup_is_asked_for_help_then_it_lists_its_modes_and_does_nothing():
    done = subprocess.run(["bash", str(ROOT / "ci" / "setup.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and all(mode in done.stdout for mode in ("(no mode)", "notebooks", "matrix"))
    assert "disk before set-up" not in done.stdout


def test_when_a_fresh_set_up_was_recorded_then_the_plan_gives_its_time_and_sizes(tmp_path, monkeypatch):
    monkeypatch.setattr(setup_plan, "RECORD", tmp_path / "setup.json")
    assert "No earlier fresh set-up is recorded" in setup_plan.plan("notebooks")
    (tmp_path / "setup.json").write_text(json.dumps({"notebooks": {
        "date": "2026-11-26", "seconds": 312, "load": "0.4", "sizes": {".venv": 3 * 2**30, ".envs/colab-shape": 2**30}}}))
    text = setup_plan.plan("notebooks")
    assert "Last measured (2026-11-26, a fresh set-up, load average 0.4 at the start): 5.2 min" in text
    assert "it made 4.0 GiB on disk (.venv 3.0 GiB, .envs/colab-shape 1.0 GiB)" in text
    releases = tomllib.loads((ROOT / "ci" / "releases.toml").read_text())
    assert f"torch {releases['torch']}" in text and f"DeepSpeed {', '.join(releases['releases'])}" in text  # from the file


def test_when_the_plan_is_for_the_main_job_then_it_makes_no_other_environment_and_the_matrix_mode_makes_each(
        tmp_path, monkeypatch):
    monkeypatch.setattr(setup_plan, "RECORD", tmp_path / "setup.json")  # no recorded sizes naming environments
    environments = tomllib.loads((ROOT / "ci" / "environments.toml").read_text())
    main, whole, tests = (setup_plan.plan(mode) for mode in ("notebooks", "matrix", "all"))
    assert environments and not any(f".envs/{name}" in main for name in environments)
    assert all(f".envs/{name}" in whole for name in environments)
    # the tests' set-up makes the environments the tests use (tests = true), and no other
    assert {name for name in environments if f".envs/{name}" in tests} == \
        {name for name, spec in environments.items() if spec.get("tests")} != set()
