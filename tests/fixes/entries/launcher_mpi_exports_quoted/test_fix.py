"""launcher-mpi-exports-quoted beyond the contract and the notebook (0.16.0, every MPI launcher): upstream's two tests
of add_export, the fix with launcher-openmpi-premature-env-check's where both bugs are installed (0.16.4), and, where a
real OpenMPI or MPICH ``mpirun`` is installed on the machine, the recording's reading of the command against it."""
import shutil
import subprocess
import sys

import pytest

from tests.helpers import call_in_release

AFFECTED = "0.16.0"
FIX_ID = "launcher-mpi-exports-quoted"


def _setup():
    import fixes
    from fixes.entries.launcher_mpi_exports_quoted import mpirun
    from fixes.harness import setup

    setup()
    return fixes, mpirun


def check_upstreams_add_export_tests():
    """tests/unit/launcher/test_user_args.py of PR #7071: a value with special characters stays quoted, a path not."""
    from deepspeed.launcher.multinode_runner import MultiNodeRunner

    fixes, _ = _setup()

    class DummyRunner(MultiNodeRunner):
        def backend_exists(self):
            return True

        def get_cmd(self, environment, active_resources):
            return []

    from types import SimpleNamespace

    runner = DummyRunner(SimpleNamespace(user_args=[], user_script="dummy_script.py"), "dummy_world_info")
    runner.add_export("PYTHONPATH", "/usr/local/lib/python3.9/site-packages")
    assert runner.exports["PYTHONPATH"] == '"/usr/local/lib/python3.9/site-packages"'  # the bug
    fixes.apply(FIX_ID)
    runner.add_export("SLURM_JOB_CPUS_PER_NODE", "64(x2)")
    runner.add_export("PYTHONPATH", " /usr/local/lib/python3.9/site-packages\n")
    assert runner.exports == {"SLURM_JOB_CPUS_PER_NODE": '"64(x2)"',
                              "PYTHONPATH": "/usr/local/lib/python3.9/site-packages"}, runner.exports


def check_every_mpi_launcher_with_the_fix():
    fixes, mpirun = _setup()
    for launcher in mpirun.MPI_LAUNCHERS:
        run = mpirun.launch(launcher=launcher)
        assert run.seen == {key: f'"{value}"' for key, value in run.expected.items()}, (launcher, run.seen)
    pdsh = mpirun.launch(launcher="pdsh")
    assert not pdsh.wrong
    fixes.apply(FIX_ID)
    for launcher in (*mpirun.MPI_LAUNCHERS, "pdsh"):
        run = mpirun.launch(launcher=launcher)
        assert run.seen == run.expected, (launcher, run.seen)
    assert mpirun.launch(launcher="pdsh").seen == pdsh.seen  # pdsh's shell removed the quotes anyway


def check_both_launcher_bugs_installed():
    """0.16.4 has both: the fix applies launcher-openmpi-premature-env-check's first (``requires``)."""
    from fixes.exceptions import CannotTellError
    from fixes.entries.launcher_mpi_exports_quoted.reproduce import launched

    fixes, mpirun = _setup()
    try:
        launched()
    except CannotTellError as exc:
        assert "launcher-openmpi-premature-env-check" in str(exc)
    else:
        raise AssertionError("the OpenMPI launcher got past its premature check")
    assert fixes.apply(FIX_ID)[0].action == "applied"
    assert fixes.get("launcher-openmpi-premature-env-check").applied
    run = launched()
    assert run.seen == run.expected, run.seen


def check_recorded_commands(out):
    """The recorded command's words that carry the variables, per MPI launcher, and what the recording says a rank
    sees (as JSON, to ``out``)."""
    import json

    _, mpirun = _setup()
    runs = {launcher: mpirun.launch(launcher=launcher) for launcher in ("openmpi", "mpich", "impi", "mvapich")}
    with open(out, "w") as file:
        json.dump({launcher: {"words": run.words(), "seen": run.seen} for launcher, run in runs.items()}, file)


def test_when_upstreams_add_export_tests_run_with_the_fix_then_they_pass():
    call_in_release(AFFECTED, check_upstreams_add_export_tests)


def test_when_the_fix_is_applied_then_every_mpi_launcher_passes_the_values_as_configured():
    call_in_release(AFFECTED, check_every_mpi_launcher_with_the_fix)


def test_when_both_launcher_bugs_are_installed_then_the_fix_brings_the_other_first():
    call_in_release("0.16.4", check_both_launcher_bugs_installed)


_REAL = {"openmpi": ("mpirun.openmpi", ["--allow-run-as-root", "-n", "1"]), "mpich": ("mpirun.mpich", ["-n", "1"])}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """The recording of each MPI launcher's command on the affected release, made once."""
    import json

    out = tmp_path_factory.mktemp("recorded") / "runs.json"
    call_in_release(AFFECTED, check_recorded_commands, args=(str(out),))
    return json.loads(out.read_text())


@pytest.mark.parametrize("launcher", ["openmpi", "mpich", "impi", "mvapich"])
def test_when_a_real_mpirun_runs_the_recorded_words_then_a_rank_sees_what_the_recording_says(launcher, request):
    """Intel MPI's and MVAPICH2's mpirun are Hydra's, as MPICH's: their words are run by MPICH's mpirun here."""
    import json

    program, options = _REAL["openmpi" if launcher == "openmpi" else "mpich"]
    if shutil.which(program) is None:
        pytest.skip(f"no {program} on this machine")
    run = request.getfixturevalue("recorded")[launcher]
    dump = "import json, os, sys; print(json.dumps({k: os.environ.get(k) for k in sys.argv[1:]}))"
    done = subprocess.run([program, *options, *run["words"], sys.executable, "-c", dump, *run["seen"]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == run["seen"]
