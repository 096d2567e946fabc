"""launcher-venv-script-drops-export beyond the contract and the notebook (0.17.2, every variable on every node): what
the fix changes in pdsh's command and what it leaves alone, and a release without --venv_script (0.16.0)."""
from tests.helpers import call_in_release

FIX_ID = "launcher-venv-script-drops-export"


def _setup():
    import fixes
    from fixes.entries.launcher_venv_script_drops_export import pdsh
    from fixes.harness import setup

    setup()
    return fixes, pdsh


def check_the_fix_adds_one_separator_and_leaves_a_launch_without_venv_script_alone():
    fixes, pdsh = _setup()
    run, plain = pdsh.launch(), pdsh.launch(venv_script=False).command
    assert run.pdsh and run.command[6].startswith("source ")
    assert run.command[7].startswith("export MLFLOW_TRACKING_URI=")
    assert run.lost == {"node-1": ["MLFLOW_TRACKING_URI"], "node-2": ["MLFLOW_TRACKING_URI"]}, run.lost
    assert not pdsh.launch(pdsh.ONE_NODE).any_lost  # one node: no pdsh, the launcher's own environment
    fixes.apply(FIX_ID)
    fixed = pdsh.launch()
    assert fixed.command[6] == run.command[6] + ";" and fixed.command[7:] == run.command[7:]
    assert pdsh.launch(venv_script=False).command == plain


def check_release_without_venv_script_is_not_affected():
    fixes, pdsh = _setup()
    fix = fixes.get(FIX_ID)
    assert not pdsh.has_venv_script()
    assert fix.probe() == fix.read_code() and not fix.probe().affected and "no --venv_script" in fix.probe().evidence
    assert fix.reproduce() is False and fixes.apply(FIX_ID)[0].action == "not needed"  # before the contract's releases


def test_when_venv_script_then_the_fix_adds_only_the_separator_and_without_it_changes_nothing():
    call_in_release("0.17.2", check_the_fix_adds_one_separator_and_leaves_a_launch_without_venv_script_alone)


def test_when_release_has_no_venv_script_then_the_probe_says_why():
    call_in_release("0.16.0", check_release_without_venv_script_is_not_affected)
