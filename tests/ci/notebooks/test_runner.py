import json
from pathlib import Path

import nbformat
import pytest

from ci.notebooks import runner


def _notebook(tmp_path, *sources):
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    params = nbformat.v4.new_code_cell("results_file = ''")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, *(nbformat.v4.new_code_cell(source) for source in sources)]
    path = tmp_path / "probe.ipynb"
    nbformat.write(nb, path)
    return path


def test_when_a_cell_hangs_then_the_run_fails_within_its_timeout(tmp_path):
    path = _notebook(tmp_path, "x = 1", "import time\ntime.sleep(600)")
    result = runner.execute(path, tmp_path / "out.ipynb", "python3", {}, cell_timeout=5)
    assert result.status == "failed"
    assert result.wall_s < 60
    assert "Timeout" in result.error or "timed out" in result.error.lower()
    assert result.failed_cell == 3  # parameters, x = 1, then the sleeping cell


def test_when_a_cell_raises_then_the_result_names_the_cell_and_error(tmp_path):
    path = _notebook(tmp_path, "x = 1", "raise ValueError('bug not reproduced')")
    result = runner.execute(path, tmp_path / "out.ipynb", "python3", {}, cell_timeout=60)
    assert result.status == "failed"
    assert result.error == "ValueError: bug not reproduced"
    assert result.failed_cell == 3  # parameters, x = 1, then this one (no injection: no parameters given)


def test_when_parameters_are_injected_then_the_notebook_sees_them(tmp_path):
    path = _notebook(tmp_path, "import json\njson.dump({'seen': results_file}, open(results_file + '.json', 'w'))")
    target = str(tmp_path / "record")
    result = runner.execute(path, tmp_path / "out.ipynb", "python3", {"results_file": target}, cell_timeout=60)
    assert result.status == "passed", result.error
    assert json.loads(open(target + ".json").read()) == {"seen": target}


def test_when_a_notebook_runs_then_its_copy_is_written_at_start_and_end_only_within_the_save_interval_and_holds_every_output(
        tmp_path, monkeypatch):
    import papermill.engines

    writes = []
    write = papermill.engines.write_ipynb
    monkeypatch.setattr(papermill.engines, "write_ipynb", lambda nb, path: (writes.append(path), write(nb, path)))
    monkeypatch.setattr(runner, "SAVE_EVERY_S", 3600.0)  # no cell takes an hour: only the start and the end
    path = _notebook(tmp_path, *(f"print({n} * 7)" for n in range(8)))
    result = runner.execute(path, tmp_path / "out.ipynb", "python3", {}, cell_timeout=60)
    assert result.status == "passed", result.error
    assert len(writes) == 2
    cells = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[1:]
    assert [cell.outputs[0]["text"] for cell in cells] == [f"{n * 7}\n" for n in range(8)]
    monkeypatch.setattr(runner, "SAVE_EVERY_S", 0.0)  # every save papermill asks for: each cell's start and end
    writes.clear()
    assert runner.execute(path, tmp_path / "out.ipynb", "python3", {}, cell_timeout=60).status == "passed"
    assert len(writes) == 2 + 2 * 9


def test_when_entry_unknown_then_matrix_refuses_with_known_ids():
    import fixes

    with pytest.raises(fixes.UnknownFixError):
        runner.matrix(["no-such-bug"])


def test_when_matrix_built_then_each_entry_runs_on_its_reproduce_and_newest_release_and_in_colab_shape():
    import fixes
    from ci import releases

    runs = runner.matrix()
    for fix in fixes.all_fixes():
        assert (fix.id, fix.info.reproduce_release, "cpu") in runs
        assert (fix.id, releases.load().newest, "cpu") in runs
        assert (fix.id, fix.info.reproduce_release, "colab-shape") in runs
    assert ("zero-grad-hook-lifetime", "0.17.6", "torch-2.0") in runs
    assert runner.matrix(environments=["cpu"]) == [run for run in runs if run[2] == "cpu"]


def test_when_environments_are_named_then_the_matrix_keeps_theirs_all_keeps_every_one_and_an_unknown_is_refused(capsys):
    runs = runner.matrix()
    assert runner.matrix(environments=[runner.ALL_ENVIRONMENTS]) == runs
    assert runner.matrix(environments=["cpu", "torch-2.0"]) == [run for run in runs if run[2] in ("cpu", "torch-2.0")]
    with pytest.raises(ValueError, match="unknown environment.*colab"):
        runner.matrix(environments=["colab"])
    assert runner.main(["--env", "colab"]) == 2
    assert "unknown environment(s) colab" in capsys.readouterr().err


def test_when_main_gets_unknown_entry_then_exit_2(capsys):
    assert runner.main(["--entry", "no-such-bug"]) == 2
    assert "unknown fix id" in capsys.readouterr().err


def test_when_kernels_start_then_each_talks_over_unix_sockets_in_its_own_directory_removed_after():
    """No TCP port for a kernel to lose to another process between the manager picking it and the kernel
    binding it (two notebooks at once: 'ZMQError: Address already in use', then 'Kernel didn't respond')."""
    import asyncio
    from pathlib import Path

    from ci import releases

    manager_class = runner.ipc_kernel_manager_class()
    first = manager_class(kernel_name=releases.kernel_name(releases.load().newest))
    second = manager_class(kernel_name=releases.kernel_name(releases.load().newest))
    assert first.transport == "ipc" and Path(first.ip).parent.is_dir()
    assert Path(first.ip).parent != Path(second.ip).parent

    async def run() -> dict:
        await second.cleanup_resources()
        await first.start_kernel()
        try:
            client = first.client()
            assert isinstance(client, runner.ready_client_class())
            client.start_channels()
            await client.wait_for_ready(timeout=120)
            reply = await client.execute_interactive("assert 6 * 7 == 42", timeout=60)
            client.stop_channels()
            return reply
        finally:
            await first.shutdown_kernel(now=True)

    reply = asyncio.run(run())
    assert reply["content"]["status"] == "ok", reply["content"]
    assert not Path(second.ip).parent.exists()
    assert not Path(first.ip).parent.exists(), "the kernel's socket directory outlived it"


def test_when_the_kernel_has_answered_then_ready_reads_what_iopub_holds_without_waiting():
    """jupyter_client's own client waits for 0.2 s of silence on IOPub after the kernel_info reply; this one waits
    only for the first IOPub message (the sockets are connected), then takes what is there and returns."""
    import asyncio
    from queue import Empty

    waits: list[tuple[str, float | None]] = []

    class Channel:
        def __init__(self, name: str, messages: list[dict]) -> None:
            self.name, self.messages = name, messages

        async def get_msg(self, timeout: float | None = None) -> dict:
            waits.append((self.name, timeout))
            if self.messages:
                return self.messages.pop(0)
            raise Empty

    reply = {"msg_type": "kernel_info_reply", "content": {}}
    shell = Channel("shell", [{"msg_type": "execute_reply"}, reply])  # a stray reply first: asked again
    iopub = Channel("iopub", [{"msg_type": "status"} for _ in range(3)])
    handled, asked = [], []

    class Client(runner.ready_client_class()):
        shell_channel = shell
        iopub_channel = iopub

        def kernel_info(self) -> None:
            asked.append(True)

        def _handle_kernel_info_reply(self, msg: dict) -> None:
            handled.append(msg)

        async def is_alive(self) -> bool:
            return True

    asyncio.run(Client().wait_for_ready(timeout=5))
    assert handled == [reply] and len(asked) == 2
    assert [timeout for name, timeout in waits if name == "iopub"] == [0.2, 0, 0, 0]
    assert iopub.messages == []


def test_when_a_notebook_runs_then_no_kernel_socket_directory_is_left(tmp_path, monkeypatch):
    import shutil
    import tempfile

    # this test's own (short: a socket's path has a length limit): other tests' kernels may run beside it
    temporary = Path(tempfile.mkdtemp(prefix="fk-"))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    made = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    result = runner.execute(_notebook(tmp_path, "x = 1"), tmp_path / "out.ipynb", "python3", {}, cell_timeout=60)
    assert result.status == "passed", result.error
    try:
        assert any(Path(path).name.startswith("fixbook-kernel-") for path in made)  # the kernel's socket directory
        assert not list(temporary.glob("fixbook-kernel-*"))
    finally:
        shutil.rmtree(temporary, ignore_errors=True)


def test_when_a_matrix_runs_then_it_goes_kernel_by_kernel_oldest_first_and_results_keep_the_given_order(
        tmp_path, monkeypatch):
    from fixes.record import RunResult

    pairs = [("a", "0.16.0", "cpu"), ("b", "0.19.8", "colab-shape"), ("c", "0.19.8", "cpu"), ("d", "0.16.0", "cpu"),
             ("e", "0.16.0", "torch-2.0"), ("f", "0.16.0", "colab-shape"), ("g", "0.18.10", "cpu")]
    ran = []

    def run_one(entry, release, cell_timeout, build, environment, kernel=None):
        assert kernel is None  # no kernels given: each environment's own
        ran.append((release, environment))
        return RunResult(entry, release, "k", "nb", "out", "passed", 0.0, environment=environment)

    monkeypatch.setattr(runner, "run_one", run_one)
    results = runner.run_matrix(pairs, cell_timeout=1, build=tmp_path)
    assert [r.entry for r in results] == list("abcdefg")
    assert ran == [("0.16.0", "cpu"), ("0.16.0", "cpu"), ("0.18.10", "cpu"), ("0.19.8", "cpu"),
                   ("0.16.0", "colab-shape"), ("0.16.0", "torch-2.0"), ("0.19.8", "colab-shape")]


def test_when_a_kernel_is_given_then_the_run_uses_it_instead_of_its_environments(tmp_path, monkeypatch):
    from fixes.record import RunResult

    used = []

    def execute(notebook, output, kernel, parameters, cell_timeout, entry="", release=""):
        used.append(kernel)
        return RunResult(entry, release, kernel, str(notebook), str(output), "passed", 0.0)

    monkeypatch.setattr(runner, "execute", execute)
    result = runner.run_one("zero3-linear-setup-context", "0.19.8", 1, tmp_path, "gpu", kernel="deepspeed-0.19.8-gpu")
    assert used == ["deepspeed-0.19.8-gpu"] and result.environment == "gpu"
    assert (tmp_path / "results" / "zero3-linear-setup-context" / "0.19.8-gpu.json").exists()


@pytest.mark.parametrize("forked", ["1", "0"])
def test_when_a_kernel_prints_outside_its_cells_then_the_line_is_in_the_builds_log_and_not_on_the_console(
        tmp_path, capfd, monkeypatch, forked):
    from ci.processes import kernels
    from ci import releases

    # Python's import-time profile: lines the kernel process writes to its stderr before any cell runs
    # (as DeepSpeed's log lines at import and Python's warnings are), whether forked from a server or not.
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")
    monkeypatch.setenv("FIXBOOK_FORK_KERNELS", forked)
    path = _notebook(tmp_path, "print('in the cell')")
    log = tmp_path / "build" / runner.KERNEL_LOG
    with kernels.servers(log=log):
        result = runner.execute(path, tmp_path / "out.ipynb", releases.kernel_name(releases.load().newest), {},
                                cell_timeout=300)
    assert result.status == "passed", result.error
    assert "import time:" in log.read_text(), "the kernel's own stderr did not reach the build's log"
    console = capfd.readouterr()
    assert "import time:" not in console.out + console.err
    cell = nbformat.read(tmp_path / "out.ipynb", as_version=4).cells[-1]
    assert "in the cell" in "".join(output.get("text", "") for output in cell.outputs)


def test_when_a_notebooks_ranks_print_then_their_lines_are_in_its_cell_and_not_on_the_console(tmp_path, capfd):
    from ci import releases

    path = _notebook(tmp_path, "from fixes import harness\nharness.setup()\n"
                               "harness.launch(print, 2, 'hello from a rank', timeout=120)")
    out = tmp_path / "out.ipynb"
    result = runner.execute(path, out, releases.kernel_name(releases.load().newest), {}, cell_timeout=300)
    assert result.status == "passed", result.error
    cell = nbformat.read(out, as_version=4).cells[-1]
    text = "".join(output.get("text", "") for output in cell.outputs)
    assert "[rank0] hello from a rank" in text and "[rank1] hello from a rank" in text, text
    console = capfd.readouterr()
    assert "hello from a rank" not in console.out + console.err  # the kernel's terminal gets none of it


def _fake_run_one(monkeypatch, ran, hold=None, fail=None):
    """run_one that writes '<pid> <entry>' to ``ran`` for each run; the run of ``hold``'s entry waits for the
    file ``hold[1]``; ``fail``'s entry raises OSError."""
    import os
    import time

    from fixes.record import RunResult

    def run_one(entry, release, cell_timeout, build, environment="cpu", kernel=None):
        if fail == entry:
            raise OSError("no kernel server could start")
        if hold is not None and entry == hold[0]:
            while not hold[1].exists():
                time.sleep(0.01)
        with open(ran, "a") as log:
            log.write(f"{os.getpid()} {entry}\n")
        return RunResult(entry, release, "k", "nb", "out", "passed", 0.0, environment=environment)

    monkeypatch.setattr(runner, "run_one", run_one)


def _ran(path):
    return [tuple(line.split()) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for(condition, what, timeout=120):
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.01)


def test_when_two_processes_share_a_matrix_then_each_run_runs_once_the_late_one_from_the_end_and_both_get_all(
        tmp_path, monkeypatch):
    import multiprocessing
    import os
    import threading

    pairs = [("a", "0.16.0", "cpu"), ("b", "0.17.0", "cpu"), ("c", "0.18.9", "cpu"), ("d", "0.19.8", "cpu")]
    release, ran, build, first_out = tmp_path / "release", tmp_path / "ran", tmp_path / "build", tmp_path / "first"
    _fake_run_one(monkeypatch, ran, hold=("a", release))

    def first() -> None:  # the worker that starts the matrix: it holds run a until the test releases it
        first_out.write_text(json.dumps([r.entry for r in runner.run_matrix_together(pairs, 1, build, poll_s=0.01)]))

    process = multiprocessing.get_context("fork").Process(target=first)
    process.start()
    claims = build / runner.CLAIMS
    _wait_for(lambda: (claims / "a@0.16.0.claim").exists(), "the first process claims run a")
    # This process comes late: it takes the rest from the other end; run a is released once they are recorded.
    releaser = threading.Thread(target=lambda: (_wait_for(lambda: all((claims / f"{e}@{r}.json").exists()
                                                                         for e, r, _ in pairs[1:]), "b, c, d"),
                                                  release.touch()))
    releaser.start()
    late = [r.entry for r in runner.run_matrix_together(pairs, 1, build, poll_s=0.01)]
    releaser.join()
    process.join(timeout=120)
    assert process.exitcode == 0
    assert late == json.loads(first_out.read_text()) == ["a", "b", "c", "d"]
    assert _ran(ran) == [(str(os.getpid()), "d"), (str(os.getpid()), "c"), (str(os.getpid()), "b"),
                         (str(process.pid), "a")]
    assert json.loads((build / "results.json").read_text())[0]["entry"] == "a"


def test_when_a_runs_claimant_ended_without_recording_it_then_another_process_takes_it_over(tmp_path, monkeypatch):
    import subprocess

    pairs = [("a", "0.19.8", "cpu"), ("b", "0.18.9", "cpu")]
    ran = tmp_path / "ran"
    _fake_run_one(monkeypatch, ran)
    ended = subprocess.Popen(["true"])
    ended.wait()
    claims = tmp_path / "build" / runner.CLAIMS
    claims.mkdir(parents=True)
    (claims / "a@0.19.8.claim").write_text(str(ended.pid))
    results = runner.run_matrix_together(pairs, 1, tmp_path / "build", poll_s=0.01)
    assert [r.entry for r in results] == ["a", "b"]
    assert sorted(entry for _, entry in _ran(ran)) == ["a", "b"]


def test_when_a_runs_claimant_raised_then_another_process_raises_its_error_without_a_second_attempt(
        tmp_path, monkeypatch):
    pairs = [("a", "0.19.8", "cpu"), ("b", "0.18.9", "cpu")]
    ran = tmp_path / "ran"
    _fake_run_one(monkeypatch, ran, fail="a")
    with pytest.raises(OSError, match="no kernel server"):  # the claimant: its own error
        runner.run_matrix_together(pairs, 1, tmp_path / "build", poll_s=0.01)
    _fake_run_one(monkeypatch, ran)  # the next process would run a; it must not try
    with pytest.raises(RuntimeError, match="a@0.19.8 failed in the process that took it: OSError: no kernel server"):
        runner.run_matrix_together(pairs, 1, tmp_path / "build", poll_s=0.01)
    assert [entry for _, entry in _ran(ran)] == ["b"]


def test_when_one_process_runs_the_shared_matrix_two_at_once_then_each_run_runs_once_and_results_keep_the_order(
        tmp_path, monkeypatch):
    """The path of ``pytest -n 0`` (matrix_jobs() gives 2 there): a pool of two processes claims from one list."""
    pairs = [("a", "0.19.8", "cpu"), ("b", "0.18.9", "cpu"), ("c", "0.17.0", "cpu"), ("d", "0.16.0", "cpu")]
    ran = tmp_path / "ran"
    _fake_run_one(monkeypatch, ran)
    results = runner.run_matrix_together(pairs, 1, tmp_path / "build", jobs=2, poll_s=0.01)
    assert [r.entry for r in results] == ["a", "b", "c", "d"]
    assert sorted(entry for _, entry in _ran(ran)) == ["a", "b", "c", "d"]
