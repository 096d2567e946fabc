"""Notebook kernels forked from a kernel server (``ci/processes/kernel_server.py``) that has imported torch and
DeepSpeed once, instead of a new Python per notebook that imports them again (about 5 s a run,
docs/performance.md).

A kernel server is started on first need, one per kernel (the kernel's Python and its ``kernel.json``
environment), in the directory that :func:`servers` makes for one runner call; every process of that
call (``--jobs`` workers) shares it, and the servers end with it. Kernels are still fresh processes: the
server imported modules and ran nothing else; each kernel gets the environment, working directory and
argv its kernel manager asked for, and leads its own process group, so an interrupt or a kill reaches it
and what it started, as with a kernel started by ``subprocess``.

Where no server can run (a GPU is visible, the server died, ``FIXBOOK_FORK_KERNELS=0``) the kernel is
started as a new process, as before, and a line on stderr says why: a run is never worse off for this.
"""
from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from . import zygote
from .kernel_server import read_line  # the server's own module imports nothing of the project

SERVER_SCRIPT = Path(__file__).with_name("kernel_server.py")
DIR_VARIABLE = "FIXBOOK_KERNEL_SERVERS"  # the directory of this runner call's servers, for its workers
LOG_VARIABLE = "FIXBOOK_KERNEL_LOG"  # the file the kernel processes' own output goes to (servers(log=...))
START_TIMEOUT_S = 180.0
IDLE_S = 15.0  # a server whose kernel's runs are done (the runner goes kernel by kernel) leaves soon
IDLE_VARIABLE = "FIXBOOK_KERNEL_SERVER_IDLE_S"  # another idle time, for servers started while it is set


class KernelServerError(RuntimeError):
    """No kernel server could start this kernel (the caller starts it as a new process instead)."""


def enabled() -> tuple[bool, str]:
    """Whether kernels are forked here, and why not if they are not."""
    if os.environ.get("FIXBOOK_FORK_KERNELS", "1") == "0":
        return False, "FIXBOOK_FORK_KERNELS=0"
    if glob.glob("/dev/nvidia[0-9]*"):
        return False, "a GPU is visible (CUDA does not survive a fork)"
    return True, ""


@contextlib.contextmanager
def servers(log: Path | None = None) -> Iterator[Path | None]:
    """The kernel servers of one runner call: a private directory, named in the environment for the
    workers this call starts; on exit every server in it is stopped and the directory removed. Yields
    None (kernels start as new processes) where :func:`enabled` says no. Where a caller's directory is
    already named in the environment (an outer ``servers()``), yields that one and leaves it to its owner.

    ``log``: a file (appended to) for what the kernel processes print outside any cell: DeepSpeed's lines at
    import, Python's warnings before a cell runs, ipykernel's own log (the interrupt jupyter_client sends every
    kernel it shuts down). A cell's output, its ranks' included, is the cell's; without ``log`` the rest goes to
    this process's terminal."""
    on, _why = enabled()
    logged = bool(log) and not os.environ.get(LOG_VARIABLE)
    if logged:
        log.parent.mkdir(parents=True, exist_ok=True)
        os.environ[LOG_VARIABLE] = str(log)
    try:
        if not on or os.environ.get(DIR_VARIABLE):
            yield Path(os.environ[DIR_VARIABLE]) if on and os.environ.get(DIR_VARIABLE) else None
            return
        directory = Path(tempfile.mkdtemp(prefix="fixbook-kservers-"))
        os.environ[DIR_VARIABLE] = str(directory)
        try:
            yield directory
        finally:
            os.environ.pop(DIR_VARIABLE, None)  # a caller may have taken it out meanwhile
            join_reapers()  # the kernels still ending finish before their servers go
            stop_servers(directory)
    finally:
        if logged:
            os.environ.pop(LOG_VARIABLE, None)


def _log_file() -> Any:
    """The open log file of :data:`LOG_VARIABLE` (append), or None: the terminal."""
    path = os.environ.get(LOG_VARIABLE)
    return open(path, "ab") if path else None


def stop_servers(directory: Path) -> None:
    for pid_file in directory.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
    shutil.rmtree(directory, ignore_errors=True)


class ForkedKernel:
    """The part of ``subprocess.Popen`` a kernel provisioner uses, for a kernel that a server forked: its
    exit status comes over the server connection."""

    stdin = stdout = stderr = None

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._buffer = b""
        self._conn: socket.socket | None = conn
        conn.setblocking(False)

    def poll(self) -> int | None:
        if self._conn is None or self.returncode is not None:
            return self.returncode
        ended = False
        try:
            while True:
                chunk = self._conn.recv(4096)
                if not chunk:
                    ended = True
                    break
                self._buffer += chunk
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:  # reset: as good as closed
            ended = True
        for line in self._buffer.splitlines():
            message = json.loads(line)
            if "exit" in message:
                self.returncode = int(message["exit"])
        if self.returncode is None and ended:  # the server has gone without a word: ask the kernel itself
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -signal.SIGKILL  # its status went with the server: reported as killed
            else:
                return None  # still running, an orphan: a kill still reaches it by pid
        if ended or self.returncode is not None:
            self._conn.close()
            self._conn = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"kernel {self.pid}", timeout or 0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


_reapers: list[threading.Thread] = []  # this process's kernels that were asked to shut down, until each has ended


def reap(kernel: ForkedKernel, wait_s: float) -> threading.Thread:
    """Let ``kernel``, which has acknowledged a shutdown request, end on its own while this process goes on: a
    thread waits up to ``wait_s`` for its exit (its ``atexit`` handlers and finalizers run, as in any shutdown),
    then kills its process group, as ``jupyter_client`` does with a kernel that does not end. Not a daemon: this
    process waits for every such thread before it exits, and :func:`servers` before it stops the servers."""
    def wait() -> None:
        try:
            kernel.wait(wait_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(kernel.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                kernel.wait(wait_s)

    thread = threading.Thread(target=wait, name=f"reap-kernel-{kernel.pid}")
    thread.start()
    _reapers.append(thread)
    return thread


def join_reapers() -> None:
    """Wait for every kernel :func:`reap` let go of in this process."""
    while _reapers:
        _reapers.pop().join()


def _key(python: str, spec_env: dict[str, str], cwd: str) -> str:
    text = json.dumps([os.path.realpath(python), sorted(spec_env.items()), os.path.realpath(cwd)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _server_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if not k.startswith("JPY_")}


def _start_server(directory: Path, key: str, python: str, env: dict[str, str], cwd: str) -> None:
    sock, pid_file = directory / f"{key}.sock", directory / f"{key}.pid"
    log = _log_file()
    try:
        proc = subprocess.Popen([*zygote.command(python, _server_env(env)), str(SERVER_SCRIPT), str(sock), "--idle",
                                 os.environ.get(IDLE_VARIABLE, str(IDLE_S)), "--parent", str(os.getpid()),
                                 "--pid-file", str(pid_file)],
                                env=_server_env(env), cwd=cwd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                start_new_session=True)
    finally:
        if log is not None:
            log.close()  # the server holds its own copy
    try:  # the process to stop until the server has written its own pid (where a zygote forked it: not this one)
        with open(pid_file, "x") as handle:
            handle.write(str(proc.pid))
    except FileExistsError:
        pass
    deadline = time.monotonic() + START_TIMEOUT_S
    while not sock.exists():
        if proc.poll() is not None:
            raise KernelServerError(f"the kernel server for {python} exited with {proc.returncode} before it served")
        if time.monotonic() > deadline:
            proc.kill()
            raise KernelServerError(f"the kernel server for {python} did not serve within {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _request(sock: Path, cmd: list[str], env: dict[str, str], cwd: str) -> ForkedKernel:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(30)
        conn.connect(str(sock))
        conn.sendall((json.dumps({"argv": cmd, "env": env, "cwd": cwd}) + "\n").encode())
        first, rest = read_line(conn, "the kernel server")
    except OSError:
        conn.close()
        raise
    answer = json.loads(first)
    if "pid" not in answer:
        conn.close()
        raise KernelServerError(f"the kernel server refused: {answer.get('error', answer)}")
    kernel = ForkedKernel(int(answer["pid"]), conn)
    kernel._buffer = rest
    return kernel


def start_kernel(directory: Path, cmd: list[str], env: dict[str, str], cwd: str,
                 spec_env: dict[str, str]) -> ForkedKernel:
    """Fork the kernel ``cmd`` (``python -m ipykernel_launcher -f FILE``) from the server for its Python and
    kernel environment, starting that server first if none runs. Raises KernelServerError if none can."""
    if cmd[1:3] != ["-m", "ipykernel_launcher"]:
        raise KernelServerError(f"not an ipykernel command: {cmd}")
    key = _key(cmd[0], spec_env, cwd)
    failed = directory / f"{key}.failed"
    with open(directory / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one start per server, whichever worker asks first
        if failed.exists():
            raise KernelServerError(failed.read_text())
        sock = directory / f"{key}.sock"
        for attempt in (1, 2):
            if not sock.exists():
                try:
                    _start_server(directory, key, cmd[0], env, cwd)
                except KernelServerError as exc:
                    failed.write_text(str(exc))
                    raise
            try:
                return _request(sock, cmd, env, cwd)
            except (OSError, ValueError) as exc:  # it left (idle) as we came: start another, once
                sock.unlink(missing_ok=True)
                if attempt == 2:
                    raise KernelServerError(f"the kernel server did not answer: {exc}") from exc
    raise AssertionError("unreachable")


def provisioner_class() -> type:
    """A ``LocalProvisioner`` that forks its kernel from this call's server, or starts it as
    ``LocalProvisioner`` does where there is none."""
    from jupyter_client.provisioning import LocalProvisioner

    class ForkedProvisioner(LocalProvisioner):  # type: ignore[misc]
        async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> Any:
            directory = os.environ.get(DIR_VARIABLE)
            cwd = str(kwargs.get("cwd") or os.getcwd())
            env = dict(kwargs.get("env") or os.environ)
            try:
                if not directory:
                    raise KernelServerError("no kernel server directory")
                kernel = start_kernel(Path(directory), cmd, env, cwd, dict(self.kernel_spec.env or {}))
            except KernelServerError as exc:
                if directory:
                    print(f"kernel started as a new process: {exc}", file=sys.stderr, flush=True)
                log = _log_file()
                if log is not None:
                    kwargs.update(stdout=log, stderr=log)
                try:
                    return await super().launch_kernel(cmd, **kwargs)
                finally:
                    if log is not None:
                        log.close()  # the kernel holds its own copy
            self.process = kernel
            self.pid = self.pgid = kernel.pid  # the kernel leads its own process group
            self.cwd = cwd
            return self.connection_info

    return ForkedProvisioner
