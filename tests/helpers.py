"""Running a check function under one DeepSpeed release, in a child process.

The pytest process itself never imports DeepSpeed: each release lives in its own directory and
only one can be imported per process. A check is a module-level function of a test file (named
``check_*`` so pytest does not collect it), passed as itself; it passes by returning and fails by raising.
"""
from __future__ import annotations

import atexit
import fcntl
import json
import os
import pickle
import select
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Callable, TypeVar

import pytest

from ci import releases
from ci.processes import zygote

T = TypeVar("T")


def call_in_release(release: str, check: Callable[..., None], timeout: float = 300, args: tuple = ()) -> str:
    """Run ``check(*args)`` (a module-level function of a test file; ``args`` plain JSON values, such as an
    entry's id) in a child process under DeepSpeed ``release``; fail the calling test with the child's output
    if it raises. Returns its stdout.

    The child is forked from that release's check server (``tests/release_server.py``, one per release,
    started on first use), which has imported torch and DeepSpeed and nothing else: a check runs as in a
    fresh process with this process's environment, without importing them again. ``timeout`` kills
    the check and every process it started. ``FIXBOOK_CHECK_SERVER=0`` starts a new Python per check
    instead, the way this worked before the server."""
    test_file, function = check.__code__.co_filename, check.__name__
    if not releases.is_installed(release):
        pytest.fail(f"DeepSpeed {release} is not installed: run `bash ci/setup.sh`")
    if os.environ.get("FIXBOOK_CHECK_SERVER", "1") == "0":
        returncode, stdout, stderr = _run_in_new_process(release, test_file, function, timeout, args)
    else:
        returncode, stdout, stderr = _servers.run(release, test_file, function, timeout, args)
    if returncode == "timeout":
        pytest.fail(f"{function} under DeepSpeed {release} ran past its {timeout:.0f} s timeout and was killed:\n"
                    f"{stdout[-3000:]}\n{stderr[-6000:]}", pytrace=False)
    if returncode != 0:
        pytest.fail(f"{function} under DeepSpeed {release} failed (exit {returncode}):\n"
                    f"{stdout[-3000:]}\n{stderr[-6000:]}", pytrace=False)
    return stdout


def _run_in_new_process(release: str, test_file: str, function: str, timeout: float,
                        args: tuple = ()) -> tuple[int | str, str, str]:
    # After the check returns, the child leaves with os._exit: interpreter teardown is not under
    # test, and DeepSpeed's/gloo's background threads can abort it (seen once in CI: SIGABRT,
    # "terminate called without an active exception", from a ZeRO-3 check on 0.19.8 that passes
    # alone every time). A failing check still raises before that line and exits 1 with its traceback.
    code = textwrap.dedent(f"""
        import os, runpy, sys
        runpy.run_path({test_file!r})[{function!r}](*{tuple(args)!r})
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
    """)
    try:
        done = releases.run_python(release, ["-c", code], timeout=timeout, capture_output=True, text=True)
    except subprocess.TimeoutExpired as expired:
        return "timeout", _text(expired.stdout), _text(expired.stderr)
    return done.returncode, done.stdout, done.stderr


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


class _Servers:
    """One check server per release, for this pytest process; each stopped when the process exits."""

    def __init__(self) -> None:
        self._running: dict[str, subprocess.Popen] = {}
        atexit.register(self.stop)

    def _server(self, release: str) -> subprocess.Popen:
        server = self._running.get(release)
        if server is None or server.poll() is not None:
            env = {**os.environ, **releases.environment(releases.check_known(release))}
            server = subprocess.Popen([*zygote.command(env=env), "-m", "tests.release_server"], cwd=releases.ROOT,
                                      env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._running[release] = server
        return server

    def run(self, release: str, test_file: str, function: str, timeout: float,
            args: tuple = ()) -> tuple[int | str, str, str]:
        server = self._server(release)
        with tempfile.TemporaryDirectory(prefix="fixbook-check-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            request = {"file": test_file, "function": function, "args": list(args), "cwd": str(releases.ROOT), "timeout": timeout,
                       "env": {**os.environ, **releases.environment(release)}, "stdout": str(out), "stderr": str(err)}
            try:
                server.stdin.write(json.dumps(request) + "\n")
                server.stdin.flush()
                ready, _, _ = select.select([server.stdout], [], [], timeout + 60)
                line = server.stdout.readline() if ready else ""
            except (BrokenPipeError, OSError):
                line = ""
            if not line:  # the server died or stopped answering: the next check starts a new one
                server.kill()
                self._running.pop(release, None)
                pytest.fail(f"the check server for DeepSpeed {release} stopped answering during {function} "
                            f"(exit {server.wait()})", pytrace=False)
            read = lambda path: path.read_text(errors="replace") if path.exists() else ""
            return json.loads(line)["returncode"], read(out), read(err)

    def stop(self) -> None:
        for server in self._running.values():
            if server.poll() is None:
                server.stdin.close()
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
        self._running.clear()


_servers = _Servers()


def pipeline_engine_classes() -> tuple[type, type]:
    """``(DeepSpeedEngine, PipelineEngine)`` of this release, after ``fixes.harness.setup()``: the classes the
    pipeline entries' fixes patch. Call inside a check."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return DeepSpeedEngine, PipelineEngine


# Identity checks some entries' own tests share (the entry contract has its own: tests/fixes/contract_checks.py).

def snapshot(owner) -> dict:
    """The attributes stored on ``owner`` (a class's own ``__dict__``), to compare by identity."""
    return dict(vars(owner))


def assert_same_objects(owner, before: dict) -> None:
    after = vars(owner)
    assert after.keys() == before.keys(), f"attributes changed: {set(after) ^ set(before)}"
    changed = [name for name, value in before.items() if after[name] is not value]
    assert not changed, f"attributes replaced: {changed}"


def assert_drift_refused(fix_id: str, *owners, says: str) -> None:
    """``fixes.apply(fix_id)`` must raise DriftError naming ``says``, replace nothing stored on ``owners`` and leave
    the fix unapplied."""
    import fixes

    before = [snapshot(owner) for owner in owners]
    try:
        fixes.apply(fix_id)
    except fixes.DriftError as exc:
        assert says in str(exc), exc
    else:
        raise AssertionError(f"{fix_id}: drifted code was patched (no DriftError naming {says!r})")
    for owner, kept in zip(owners, before):
        assert_same_objects(owner, kept)
    assert not fixes.get(fix_id).applied


def shared_directory(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A directory of this test run that every pytest-xdist worker sees (``-n 2``, pyproject.toml), the same for
    the same ``name``; without xdist, a new temporary directory."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return tmp_path_factory.mktemp(name)
    shared = tmp_path_factory.getbasetemp().parent / f"shared-{name}"  # the run's root, above each worker's
    shared.mkdir(exist_ok=True)
    return shared


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], T]) -> T:
    """``make(directory)``'s value, made once per test run. The tests run on pytest-xdist workers (``-n 2``,
    pyproject.toml), each with its own session: the first worker to ask makes it in a directory every worker
    sees (:func:`shared_directory`), under a lock, and keeps the value there (pickled); the others wait for the
    lock and read it, or the error it raised. Without xdist it is made here, in a temporary directory."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    shared = shared_directory(tmp_path_factory, f"made-once-{name}")
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        value_file = shared / "value.pickle"
        if not value_file.exists():
            work = shared / "work"
            work.mkdir(exist_ok=True)
            try:
                value = make(work)
            except Exception as exc:  # the other workers get this failure, not a second attempt
                value_file.write_bytes(pickle.dumps((False, f"{type(exc).__name__}: {exc}")))
                raise
            value_file.write_bytes(pickle.dumps((True, value)))
            return value
        ok, value = pickle.loads(value_file.read_bytes())
    if not ok:
        raise RuntimeError(f"{name}, made by another worker of this run, failed: {value}")
    return value  # type: ignore[return-value]
