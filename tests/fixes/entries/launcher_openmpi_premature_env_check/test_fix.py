"""launcher-openmpi-premature-env-check beyond the contract and the notebook (0.17.2, the launch over two nodes): what
the fix leaves of validate_args, upstream's own test (the runner built without OMPI_COMM_WORLD_* variables), and a
release with upstream's fix (0.18.4)."""
from tests.helpers import call_in_release

AFFECTED = "0.17.2"
FIX_ID = "launcher-openmpi-premature-env-check"
MESSAGE = "MPI environment variables are not set. Ensure you are running the script with an MPI-compatible launcher."


def _setup():
    import fixes
    from fixes.entries.launcher_openmpi_premature_env_check import mpirun
    from fixes.harness import setup

    setup()
    return fixes, mpirun


def check_the_fix_removes_only_the_premature_check():
    fixes, mpirun = _setup()
    assert mpirun.launch().error == f"OSError: {MESSAGE}"
    assert mpirun.launch(mpirun.ONE_NODE).error is None  # one node: no OpenMPI runner
    pdsh = mpirun.launch(launcher="pdsh").command
    fixes.apply(FIX_ID)
    fixed = mpirun.launch()
    assert fixed.error is None and fixed.done().all(), fixed.rows()
    assert fixed.command[:5] == ("mpirun", "-n", "2", "-hostfile", "hostfile"), fixed.command
    # validate_args' other checks still run
    assert mpirun.launch(options=("--num_nodes", "2")).error == \
        "ValueError: openmpi backend does not support limiting num nodes/gpus"
    assert mpirun.launch(launcher="pdsh").command == pdsh  # the other runners are not touched


def check_upstream_runner_without_mpi_variables():
    """Upstream's test_openmpi_runner, without its fixture that set the OMPI_COMM_WORLD_* variables (PR #7751)."""
    import os

    from deepspeed.launcher import multinode_runner as mnrunner
    from deepspeed.launcher.runner import encode_world_info, parse_args

    fixes, _ = _setup()
    for name in ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        os.environ.pop(name, None)
    hosts = {"worker-0": 4, "worker-1": 4}
    world_info = encode_world_info({"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]})
    args = parse_args(["test_launcher.py"])
    try:
        mnrunner.OpenMPIRunner(args, world_info, hosts)
    except OSError as exc:
        assert str(exc) == MESSAGE
    else:
        raise AssertionError("the runner was built without the OMPI_COMM_WORLD_* variables")
    before = {name: os.environ.get(name) for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE")}
    fixes.apply(FIX_ID)
    cmd = mnrunner.OpenMPIRunner(args, world_info, hosts).get_cmd({}, hosts)
    assert "mpirun" in cmd and "eth0" in cmd
    assert {name: os.environ.get(name) for name in before} == before  # nothing copied into the launcher's environment


def check_release_with_upstreams_fix_is_not_affected():
    fixes, mpirun = _setup()
    fix = fixes.get(FIX_ID)
    assert not fix.probe().affected and "does not call" in fix.probe().evidence
    assert mpirun.launch().error is None and fixes.apply(FIX_ID)[0].action == "not needed"


def test_when_the_fix_is_applied_then_only_the_premature_check_is_gone():
    call_in_release(AFFECTED, check_the_fix_removes_only_the_premature_check)


def test_when_upstreams_runner_test_has_no_mpi_variables_then_the_fix_lets_it_build_the_command():
    call_in_release(AFFECTED, check_upstream_runner_without_mpi_variables)


def test_when_release_has_upstreams_fix_then_the_probe_says_so():
    call_in_release("0.18.4", check_release_with_upstreams_fix_is_not_affected)
