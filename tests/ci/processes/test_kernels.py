"""Kernels forked from a kernel server (ci.processes.kernels, ci/processes/kernel_server.py), driven as the runner drives them."""
import json
import os
import time

import nbformat
import pytest

from ci.processes import kernels
from ci import releases
from ci.notebooks import runner


def _kernel() -> str:
    return releases.kernel_name(releases.load().newest)


def _notebook(tmp_path, name, *sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": _kernel(), "language": "python", "display_name": _kernel()}
    params = nbformat.v4.new_code_cell("results_file = ''")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, *(nbformat.v4.new_code_cell(source) for source in sources)]
    path = tmp_path / f"{name}.ipynb"
    nbformat.write(nb, path)
    return path


REPORT = """
import json, os, sys
json.dump({"pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "cwd": os.getcwd(),
           "preloaded": "deepspeed" in sys.modules, "marker": os.environ.get("FIXBOOK_TEST_MARKER"),
           "seen_before": "LEFT_BY_A_NOTEBOOK" in globals() or hasattr(sys, "fixbook_left_by_a_notebook"),
           "ds_release": os.environ.get("FIXBOOK_DEEPSPEED_RELEASE"),
           "deferred_preloaded": [name in sys.modules for name in ("torch._dynamo", "torch._inductor.compile_fx")],
           "fixbook_preloaded": "fixes.harness" in sys.modules,
           "applied": [fix.id for fix in __import__("fixes.fix").fix.applied_fixes()],
           "history": str(get_ipython().history_manager.hist_file),
           "poller": type(__import__("ipykernel.kernelapp").kernelapp.IPKernelApp.instance().poller).__name__,
           "parent_handle": __import__("ipykernel.kernelapp").kernelapp.IPKernelApp.instance().parent_handle},
          open(results_file, "w"))
LEFT_BY_A_NOTEBOOK = 1
sys.fixbook_left_by_a_notebook = 1
"""


# How long the tests that check a kernel ends through its own shutdown let it take before the kill that
# ``kernels.reap`` makes after the manager's shutdown wait (5 s): on a loaded machine a kernel's exit took longer
# than 5 s (a fresh clone's test run, two workers), and the test must not depend on that moment.
LOADED_MACHINE_WAIT_S = 120.0


def _run(tmp_path, name, *sources, timeout=120):
    return runner.execute(_notebook(tmp_path, name, *sources), tmp_path / f"{name}-out.ipynb", _kernel(),
                          {"results_file": str(tmp_path / f"{name}.json")}, cell_timeout=timeout)


@pytest.fixture
def server_dir(monkeypatch):
    monkeypatch.delenv(kernels.DIR_VARIABLE, raising=False)
    monkeypatch.delenv("FIXBOOK_FORK_KERNELS", raising=False)
    with kernels.servers() as directory:
        assert directory is not None and directory.is_dir()
        yield directory
    assert not directory.exists(), "the runner call's server directory outlived it"


def test_when_servers_run_then_each_notebook_gets_a_fresh_forked_kernel_with_its_managers_environment(
        tmp_path, server_dir, monkeypatch):
    monkeypatch.setenv("FIXBOOK_TEST_MARKER", "first")
    first = _run(tmp_path, "first", REPORT)
    monkeypatch.setenv("FIXBOOK_TEST_MARKER", "second")
    second = _run(tmp_path, "second", REPORT)
    assert first.status == second.status == "passed", (first.error, second.error)
    one, two = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("first", "second"))
    server_pids = {int(p.read_text()) for p in server_dir.glob("*.pid")}
    assert len(server_pids) == 1, "one server for one kernel"
    assert one["ppid"] == two["ppid"] in server_pids, "both kernels are children of the server"
    assert one["pid"] != two["pid"]
    assert one["pgid"] == one["pid"] and two["pgid"] == two["pid"], "each kernel leads its own process group"
    assert one["preloaded"] and two["preloaded"], "DeepSpeed was imported by the server, not again"
    assert one["deferred_preloaded"] == [True, True], \
        "what a first engine build imports (0.19.8 defers it from import deepspeed) was imported by the server too"
    assert (one["marker"], two["marker"]) == ("first", "second"), "the environment at start, not the server's"
    assert one["fixbook_preloaded"] and one["applied"] == two["applied"] == [], "the harness imported, nothing applied"
    assert one["history"] == ":memory:", "IPython's history is kept in memory, not in the user's history.sqlite"
    assert not one["seen_before"] and not two["seen_before"], "nothing of one notebook reaches the next"
    assert one["ds_release"] == releases.load().newest
    assert one["parent_handle"] == one["ppid"] and one["poller"] == "ParentPollerUnix", \
        "the kernel watches its parent (the server) and ends with it, as a launched kernel watches its manager"
    assert one["cwd"] == str(runner.ROOT)


def test_when_a_forked_kernel_launches_ranks_then_they_come_from_its_own_forked_rank_server_and_tracker(
        tmp_path, server_dir, monkeypatch):
    exits = []
    poll = kernels.ForkedKernel.poll

    def recorded_poll(self):
        code = poll(self)
        if code is not None and not exits:
            exits.append(code)
        return code

    monkeypatch.setattr(kernels.ForkedKernel, "poll", recorded_poll)
    reap = kernels.reap  # however loaded the machine, the kernel has 120 s to end on its own before the kill
    monkeypatch.setattr(kernels, "reap", lambda kernel, wait_s: reap(kernel, LOADED_MACHINE_WAIT_S))
    result = _run(tmp_path, "ranks", REPORT, """
import json, os
from multiprocessing import forkserver
from fixes import harness
from multiprocessing import resource_tracker
import psutil
before_launch = forkserver._forkserver._forkserver_pid
tracker_before_launch = resource_tracker._resource_tracker._fd is not None
outside_group = [c.pid for c in psutil.Process().children() if os.getpgid(c.pid) != os.getpgrp()]
rank_parents = harness.launch(os.getppid, 2)
server_pid = forkserver._forkserver._forkserver_pid
with open(f"/proc/{server_pid}/stat") as stat:
    server_parent = int(stat.read().split(")")[-1].split()[1])
json.dump({"rank_parents": [int(p) for p in rank_parents], "server_pid": server_pid, "server_parent": server_parent,
           "kernel": os.getpid(), "before_launch": before_launch,
           "tracker_before_launch": tracker_before_launch, "outside_group": outside_group}, open(results_file + ".ranks", "w"))
""")
    assert result.status == "passed", result.error
    kernels.join_reapers()  # the kernel ends on its own after the run (kernels.reap)
    ranks = json.loads((tmp_path / "ranks.json.ranks").read_text())
    assert ranks["before_launch"] == ranks["server_pid"], "forked with the kernel, not spawned at its first launch"
    assert ranks["server_parent"] == ranks["kernel"], "the rank server is the kernel's own child"
    assert ranks["rank_parents"] == [ranks["server_pid"]] * 2, "both ranks forked from it"
    assert ranks["tracker_before_launch"] and len(ranks["outside_group"]) == 1, \
        "the resource tracker is forked too, outside the kernel's process group (ipykernel's shutdown waits for none)"
    assert exits == [0], "the kernel ended through its own shutdown, not its manager's SIGTERM (-15) after 2.5 s"


def test_when_deepspeed_logs_in_a_forked_kernel_then_the_line_is_in_the_notebooks_output(tmp_path, server_dir):
    result = _run(tmp_path, "logs", "from deepspeed.utils import logger\nlogger.warning('fixbook-marker-in-the-notebook')")
    assert result.status == "passed", result.error
    outputs = [output.get("text", "") for cell in nbformat.read(result.executed, as_version=4).cells
               for output in cell.get("outputs", [])]
    assert any("fixbook-marker-in-the-notebook" in text for text in outputs), outputs


def test_when_a_cell_hangs_then_the_timeout_interrupts_the_forked_kernel_and_it_ends(tmp_path, server_dir):
    result = _run(tmp_path, "hang", REPORT, "import time\ntime.sleep(600)", timeout=5)
    assert result.status == "failed"
    assert result.wall_s < 60
    assert "Timeout" in result.error or "timed out" in result.error.lower()
    assert result.failed_cell == 4  # parameters, injected parameters, REPORT, then the sleeping cell
    pid = json.loads((tmp_path / "hang.json").read_text())["pid"]
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "the hung kernel outlived its run"


def test_when_a_kernel_dies_then_the_run_fails_naming_it(tmp_path, server_dir):
    result = _run(tmp_path, "dies", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", timeout=60)
    assert result.status == "failed"
    assert "dead" in result.error.lower() or "died" in result.error.lower(), result.error


def test_when_no_server_can_start_then_the_kernel_starts_as_a_new_process_and_says_so(
        tmp_path, server_dir, monkeypatch, capfd):
    broken = tmp_path / "broken_server.py"
    broken.write_text("import sys\nsys.exit('cannot serve')\n")
    monkeypatch.setattr(kernels, "SERVER_SCRIPT", broken)
    result = _run(tmp_path, "fallback", REPORT)
    assert result.status == "passed", result.error
    report = json.loads((tmp_path / "fallback.json").read_text())
    assert not report["preloaded"] and report["ppid"] == os.getpid(), "a kernel of its own, started by the manager"
    assert "kernel started as a new process: the kernel server" in capfd.readouterr().err
    assert list(server_dir.glob("*.failed")), "the failure is remembered: the next run does not wait for it again"


def test_when_the_runner_call_ends_then_its_servers_have_ended(tmp_path, monkeypatch):
    monkeypatch.delenv(kernels.DIR_VARIABLE, raising=False)
    monkeypatch.delenv("FIXBOOK_FORK_KERNELS", raising=False)
    with kernels.servers() as directory:
        assert _run(tmp_path, "one", REPORT).status == "passed"
        pids = [int(p.read_text()) for p in directory.glob("*.pid")]
        assert pids and all(_alive(pid) for pid in pids)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)
    assert kernels.DIR_VARIABLE not in os.environ


def test_when_fork_kernels_is_off_then_no_server_directory_is_made(monkeypatch):
    monkeypatch.delenv(kernels.DIR_VARIABLE, raising=False)
    monkeypatch.setenv("FIXBOOK_FORK_KERNELS", "0")
    with kernels.servers() as directory:
        assert directory is None
        assert kernels.DIR_VARIABLE not in os.environ


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process counts as ended
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_when_the_servers_starter_ends_during_its_imports_then_the_server_leaves(tmp_path):
    # The starter (a shell) ends at once, while the server is still importing torch and DeepSpeed; the server
    # must not take its new parent (init) for its starter and stay for its whole idle time.
    import subprocess
    import sys

    sock = tmp_path / "s.sock"
    started = subprocess.run(["sh", "-c", f'"{sys.executable}" "{kernels.SERVER_SCRIPT}" "{sock}" --idle 3600 '
                              '--parent $$ >/dev/null 2>&1 </dev/null & echo $!'],
                             capture_output=True, text=True, check=True)
    pid = int(started.stdout.strip())
    deadline = time.monotonic() + 120
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _alive(pid)
    if alive:
        os.kill(pid, 9)
    assert not alive, "the server outlived its starter (it would have stayed an hour)"


START_RANK_SERVER = """
import json, os, sys
from multiprocessing import forkserver
from ci.processes.kernel_server import start_rank_server
start_rank_server()
server_pid = forkserver._forkserver._forkserver_pid
from fixes import harness
harness.setup()
rank_parents = [int(pid) for pid in harness.launch(os.getppid, 2)]
print(json.dumps({"me": os.getpid(), "server_pid": server_pid, "rank_parents": rank_parents,
                  "server_after": forkserver._forkserver._forkserver_pid}))
"""


def test_when_a_measuring_child_starts_its_rank_server_then_its_ranks_fork_from_its_own_child():
    """What a ``ci.sweep`` or ``ci.sweep.triggers`` child does first: the launches that follow fork their ranks from a
    copy of the child made before ``harness.setup()``, not from a new Python that imports torch and DeepSpeed."""
    release = releases.load().newest
    done = releases.run_python_any(release, ["-c", START_RANK_SERVER], timeout=300, capture_output=True, text=True,
                                   extra_env={"DS_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["server_pid"] is not None, "no rank server was forked"
    assert found["rank_parents"] == [found["server_pid"]] * 2, "both ranks forked from the child's own server"
    assert found["server_after"] == found["server_pid"], "the launch used it and started no other"


def test_when_a_run_returns_then_its_kernel_ends_on_its_own_with_its_finalizers(tmp_path, server_dir, monkeypatch):
    reaped = []
    reap = kernels.reap
    monkeypatch.setattr(kernels, "reap",
                        lambda kernel, wait_s: reaped.append(kernel.pid) or reap(kernel, LOADED_MACHINE_WAIT_S))
    kept = ("import json, os, tempfile\nKEPT = tempfile.TemporaryDirectory()\n"
            "json.dump({'pid': os.getpid(), 'kept': KEPT.name}, open(results_file, 'w'))")
    result = _run(tmp_path, "ends", kept)
    assert result.status == "passed", result.error
    seen = json.loads((tmp_path / "ends.json").read_text())
    assert reaped == [seen["pid"]]  # acknowledged the shutdown request: not waited for in the run
    kernels.join_reapers()
    assert not _alive(seen["pid"])
    assert not os.path.exists(seen["kept"]), "the kernel was killed: its TemporaryDirectory's finalizer never ran"


def test_when_a_kernel_does_not_end_after_its_shutdown_then_its_process_group_is_killed():
    import signal
    import subprocess

    stuck = subprocess.Popen(["sleep", "600"], start_new_session=True)

    class Kernel:
        pid = stuck.pid
        waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise subprocess.TimeoutExpired("kernel", timeout)
            return stuck.wait(timeout)

    kernels.reap(Kernel(), 0.01)
    kernels.join_reapers()
    assert stuck.returncode == -signal.SIGKILL


def test_when_a_kernel_exits_then_only_torchs_operator_library_finalizers_are_left_out():
    import weakref

    from ci.processes import kernel_server

    class Owner:
        pass

    def unregister():
        pass

    def keep():
        pass

    unregister.__module__ = "torch.library"  # as torch.library._del_library
    owners = [Owner(), Owner()]
    library, other = weakref.finalize(owners[0], unregister), weakref.finalize(owners[1], keep)
    try:
        kernel_server._skip_torch_library_finalizers()
        assert (library.atexit, other.atexit) == (False, True)
    finally:
        library.detach(), other.detach()
