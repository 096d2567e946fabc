"""launcher-venv-script-drops-export on its reproduce release (0.17.2), on the first release with --venv_script
(0.17.1), on one without it (0.16.0) and on the newest (fixed) one, in child processes."""
from ci import releases
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.17.2"
WITHOUT_VENV_SCRIPT = "0.16.0"
FIX_ID = "launcher-venv-script-drops-export"


def _runner_class():
    from fixes.harness import setup

    setup()
    from deepspeed.launcher.multinode_runner import PDSHRunner

    return PDSHRunner


def check_the_first_export_is_lost_and_the_fix_brings_every_one():
    import fixes
    from fixes.entries.launcher_venv_script_drops_export import pdsh

    _runner_class()
    run = pdsh.launch()
    assert run.pdsh and run.command[6].startswith("source ") and run.command[7].startswith("export MLFLOW_TRACKING_URI=")
    assert run.lines[0].split()[2] == "export", run.lines[0]  # `source <script> export ...`: no `;` between
    assert run.lost == {"node-1": ["MLFLOW_TRACKING_URI"], "node-2": ["MLFLOW_TRACKING_URI"]}, run.lost
    assert pdsh.launch(shell={}).lost == {"node-1": ["PYTHONPATH"], "node-2": ["PYTHONPATH"]}
    assert not pdsh.launch(venv_script=False).any_lost  # the cause is --venv_script
    assert not pdsh.launch(pdsh.ONE_NODE).any_lost  # one node: no pdsh, the launcher's own environment
    fixes.apply(FIX_ID)
    try:
        fixed = pdsh.launch()
        assert fixed.command[6] == run.command[6] + ";" and fixed.command[7:] == run.command[7:]
        assert all(seen == fixed.expected for seen in fixed.seen), fixed.seen
        assert not pdsh.launch(shell={}).any_lost
    finally:
        fixes.revert(FIX_ID)


def check_without_venv_script_the_fix_changes_nothing():
    import fixes
    from fixes.entries.launcher_venv_script_drops_export import pdsh

    _runner_class()
    before = pdsh.launch(venv_script=False).command
    fixes.apply(FIX_ID)
    try:
        assert pdsh.launch(venv_script=False).command == before
    finally:
        fixes.revert(FIX_ID)


def check_release_without_venv_script_is_not_affected():
    import fixes
    from fixes.entries.launcher_venv_script_drops_export import pdsh

    runner_class = _runner_class()
    fix = fixes.get(FIX_ID)
    assert not pdsh.has_venv_script()
    assert fix.probe() == fix.read_code() and not fix.probe().affected
    assert "no --venv_script" in fix.probe().evidence
    assert fix.reproduce() is False
    assert_noop_on_fixed_release(FIX_ID, runner_class)


def check_fixed_release_is_a_noop():
    import fixes
    from fixes.entries.launcher_venv_script_drops_export import pdsh

    assert_noop_on_fixed_release(FIX_ID, _runner_class())
    assert fixes.get(FIX_ID).reproduce() is False
    assert pdsh.launch().lines[0].split()[1].endswith(";")  # upstream's own `source <script>;`


def test_when_venv_script_then_the_first_export_is_lost_and_with_the_fix_every_variable_arrives():
    call_in_release(AFFECTED, check_the_first_export_is_lost_and_the_fix_brings_every_one)


def test_when_no_venv_script_then_the_fix_leaves_the_command_as_it_is():
    call_in_release(AFFECTED, check_without_venv_script_the_fix_changes_nothing)


def test_when_release_has_no_venv_script_then_not_affected_and_apply_is_a_noop():
    call_in_release(WITHOUT_VENV_SCRIPT, check_release_without_venv_script_is_not_affected)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
