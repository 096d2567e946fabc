"""The zygote (ci/processes/zygote.py): a command forked from it behaves as the same command run by ``python``."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ci import releases
from ci.processes import zygote

REPORT = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path": sys.path[:3], "cwd": os.getcwd(), "marker": os.environ.get("MARKER"),
                  "torch_preloaded": "torch" in sys.modules, "own_group": os.getpgrp() == os.getpid(),
                  "main": sorted(k for k in vars(sys.modules["__main__"]) if not k.startswith("__"))}))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


def _forked() -> list[str]:
    start = zygote.command()
    assert start[0] == sys.executable and "run" in start, f"no zygote here: {start}"
    return start


def test_when_a_command_is_forked_then_it_sees_its_own_argv_path_environment_and_status(tmp_path):
    done = subprocess.run([*_forked(), "-c", REPORT, "a", "b"], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "MARKER": "m", "PYTHONPATH": f"{tmp_path}/x{os.pathsep}{tmp_path}/y"})
    assert done.returncode == 3, done.stderr
    found = json.loads(done.stdout)
    assert found["argv"] == ["-c", "a", "b"]
    assert found["path"] == ["", f"{tmp_path}/x", f"{tmp_path}/y"], "PYTHONPATH after '' as `python -c` puts it"
    assert found["cwd"] == str(tmp_path) and found["marker"] == "m"
    assert found["torch_preloaded"], "forked from the zygote, which imported torch"
    assert found["own_group"], "its own process group: a kill of it reaches what it started"
    assert found["main"] == ["json", "os", "sys"], "a fresh __main__, not the zygote's"
    assert done.stderr == "to stderr\n"


def test_when_a_module_is_run_then_it_is_main_with_the_working_directory_first(tmp_path):
    (tmp_path / "fixbook_zygote_probe.py").write_text(
        "import json, os, sys\nif __name__ == '__main__':\n"
        "    print(json.dumps({'argv0': sys.argv[0], 'rest': sys.argv[1:], 'path0': sys.path[0]}))\n")
    done = subprocess.run([*_forked(), "-m", "fixbook_zygote_probe", "--x"], capture_output=True, text=True,
                          cwd=tmp_path, check=True)
    found = json.loads(done.stdout)
    assert found == {"argv0": str(tmp_path / "fixbook_zygote_probe.py"), "rest": ["--x"], "path0": str(tmp_path)}


def test_when_a_script_is_run_then_it_is_main_with_its_directory_first(tmp_path):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text("import json, sys\nprint(json.dumps({'main': __name__, 'argv': sys.argv, 'path0': sys.path[0]}))\n")
    done = subprocess.run([*_forked(), str(script), "x"], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert json.loads(done.stdout) == {"main": "__main__", "argv": [str(script), "x"], "path0": str(script.parent)}


def test_when_the_stub_is_killed_by_a_timeout_then_the_forked_command_and_its_children_end(tmp_path):
    pids = tmp_path / "pids"
    code = (f"import os, subprocess, time\nchild = subprocess.Popen(['sleep', '300'])\n"
            f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}')\ntime.sleep(300)\n")
    proc = subprocess.Popen([*_forked(), "-c", code])
    while not pids.exists() or len(pids.read_text().split()) < 2:
        assert proc.poll() is None, "the command ended before it wrote its pids"
        time.sleep(0.05)
    proc.kill()  # what subprocess.run does at its timeout: SIGKILL to the stub alone
    proc.wait()
    for pid in map(int, pids.read_text().split()):
        deadline = time.monotonic() + 30  # the zygote polls every 0.05 s; a loaded machine is slower
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid), f"{pid} outlived the stub"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_when_the_stub_gets_a_signal_then_the_command_gets_it_and_the_status_says_so(tmp_path, signum):
    ready = tmp_path / "ready"
    code = f"import time\nopen({str(ready)!r}, 'w').close()\ntime.sleep(300)\n"
    proc = subprocess.Popen([*_forked(), "-c", code], stderr=subprocess.PIPE, text=True)
    while not ready.exists():
        assert proc.poll() is None
        time.sleep(0.05)
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == -signum, proc.stderr.read()
    if signum == signal.SIGINT:
        assert "KeyboardInterrupt" in proc.stderr.read(), "Python's own handler ran in the command"


def test_when_a_startup_variable_differs_then_the_zygote_refuses_and_the_command_runs_in_a_new_python():
    done = subprocess.run([*_forked(), "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                          text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "7"})
    assert done.stdout.strip() == "False", "torch reads OMP_NUM_THREADS when it starts: not the zygote's torch"


def test_when_a_command_has_its_own_startup_variables_then_a_zygote_started_with_them_serves_it(monkeypatch):
    monkeypatch.setattr(zygote, "_started", {})  # free slots, whatever zygotes earlier tests in this process started
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    done = subprocess.run([*zygote.command(env=env), "-c", "import os, sys; print('torch' in sys.modules, "
                           "os.environ['OMP_NUM_THREADS'])"], capture_output=True, text=True, check=True, env=env)
    assert done.stdout.split() == ["True", "3"]


def test_when_another_python_or_turned_off_then_the_command_is_plain(monkeypatch):
    assert zygote.command("/usr/bin/python3") == ["/usr/bin/python3"]
    monkeypatch.setenv("FIXBOOK_ZYGOTE", "0")
    assert zygote.command() == [sys.executable]


def test_when_a_release_child_is_forked_then_it_imports_that_releases_deepspeed():
    release = releases.load().newest
    done = releases.run_python_any(release, ["-c", "import deepspeed, sys; print(deepspeed.__version__, "
                                             "deepspeed.__file__, 'torch' in sys.modules)"],
                                   capture_output=True, text=True, check=True)
    version, path, preloaded = done.stdout.strip().splitlines()[-1].split()  # DeepSpeed may log before
    assert version == release and path.startswith(str(releases.install_dir(release)))
    assert preloaded == "True", "run_python_any forks from the zygote"


def test_when_a_fork_of_the_caller_exits_then_the_callers_zygote_still_serves():
    start = _forked()
    pid = os.fork()
    if pid == 0:  # what a forked kernel runs at its end: every exit handler it inherited
        import atexit

        atexit._run_exitfuncs()
        os._exit(0)
    os.waitpid(pid, 0)
    assert zygote.command() == start
    done = subprocess.run([*start, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr


def test_when_the_argv_has_another_option_then_the_command_runs_in_a_new_python():
    done = subprocess.run([*_forked(), "-X", "importtime", "-c", "import sys; print('torch' in sys.modules)"],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False" and "import time:" in done.stderr, "-X is Python's own: not forked"


def test_when_a_process_shares_its_zygote_then_its_forks_use_it_and_start_none(monkeypatch):
    monkeypatch.setenv(zygote.SHARED_VARIABLE, "{}")  # what share() names goes with the test
    assert zygote.share()
    start = zygote.command()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # a runner's pool worker: forked after share()
        os.write(write, json.dumps({"start": zygote.command(), "own": len(zygote._started) - 1}).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    seen = json.loads(os.read(read, 65536))
    os.close(read)
    assert seen["start"] == start, "the fork uses the zygote its parent shares"
    assert seen["own"] == 0, "the fork started no zygote of its own"


def test_when_a_shared_zygote_is_gone_then_a_process_starts_its_own(monkeypatch, tmp_path):
    monkeypatch.setattr(zygote, "_started", {})
    key = json.dumps(sorted(zygote._startup_environment(dict(os.environ)).items()))
    monkeypatch.setenv(zygote.SHARED_VARIABLE, json.dumps({key: str(tmp_path / "gone" / "socket")}))
    start = zygote.command()
    assert "run" in start and start[start.index("run") + 1] != str(tmp_path / "gone" / "socket")
    done = subprocess.run([*start, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True, text=True)
    assert done.stdout.strip() == "True", done.stderr
