"""A kernel server: a Python process that imports torch and DeepSpeed once, then forks one fresh Jupyter
kernel per request (see ``ci.processes.kernels``, its client).

Run as ``python ci/processes/kernel_server.py SOCKET`` by the kernel's own Python (a release's kernel, an environment's
venv), in the directory kernels start in, with the kernel's environment. It needs nothing of the project (it
imports the ``fixes`` package only where that Python has it: :func:`_preload_fixbook`), so it runs under any
environment of ``ci/environments.toml``.

Protocol, one Unix-socket connection per kernel, JSON lines:
    client -> server  {"argv": [python, "-m", "ipykernel_launcher", "-f", CONNECTION_FILE], "env": {...}, "cwd": DIR}
    server -> client  {"pid": PID}                 the kernel runs, leader of its own process group
                      {"exit": CODE}               later, when it has ended (a signal N is -N)
                      {"error": TEXT}              instead of "pid": nothing was started
A kernel is a fresh process: forked from a server that imported modules and ran nothing else, with the
request's environment, working directory and argv; it leaves through ``atexit`` as a kernel started by
``python -m ipykernel_launcher`` would. Its forkserver for ranks (``fixes.harness.launch``) is forked too, as
its own child, instead of spawned at its first launch (:func:`fork_rank_server`), and its resource tracker
(:func:`_fork_resource_tracker`). The server leaves when the process that started it has gone, or
after ``--idle`` seconds with no kernel running and no request.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import selectors
import socket
import sys
import time
import traceback

# As `python -m ipykernel_launcher` started in this directory: the working directory first on sys.path,
# not this script's directory (whose modules would shadow others' names).
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path[0] = os.getcwd()

PRELOAD = ("torch", "deepspeed")
# Imported too where this Python has them: what ``import deepspeed`` imports on 0.18.3 - 0.19.7 and a first engine
# build imports on 0.19.8, which defers them (a torch optimizer's constructor imports torch._dynamo; ZeRO's
# optimizer check imports DeepSpeed's Muon, whose torch.compile imports Inductor): about 1.7 s in each new process.
# Then ipykernel's kernel and shell (``ipykernel.ipkernel``: IPython, jupyter_client, zmq, tornado), which every
# kernel imports before it runs a cell: a one-cell notebook's run took 0.54 s of CPU, against 0.65 without. Not
# ``ipykernel.kernelapp``: its ``IPKernelApp`` reads the kernel's own variables (``JPY_PARENT_PID``,
# ``JPY_INTERRUPT_EVENT``) in its class body, when it is imported; each kernel imports it itself. Then ipykernel's
# debugger (``ipykernel.debugger``: debugpy and its pydevd), which every kernel's ``IPythonKernel`` imports when it
# is made: IPKernelApp.initialize in a forked kernel took 0.12 s of CPU with it imported, against 0.15 - 0.21 s
# without. Importing them starts no thread and opens no socket.
# Then, where the release has them, the modules a DeepSpeed engine's set-up imports on 0.17.6 and newer: ZeRO's
# optimizer check imports DeepSpeed's Muon, whose ``torch.compile`` decorators look up torch's trace rules, which a
# rank's ``init_process_group`` has just cleared, so each rank built them again; 0.19.3 and newer's expert-parallel
# config and layer. In a rank forked after ``init_process_group``: 0.087 s of CPU for the three, 0.0 s preloaded.
PRELOAD_IF_PRESENT = ("torch._dynamo", "torch._inductor.compile_fx", "ipykernel.ipkernel", "ipykernel.debugger",
                      "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.module_inject.auto_ep_config",
                      "deepspeed.module_inject.auto_ep_layer")


def _preload() -> None:
    """Import what every kernel imports (those of :data:`PRELOAD` that this Python has, then those of
    :data:`PRELOAD_IF_PRESENT` it can), as a notebook's first cell would find them. DeepSpeed picks its
    accelerator at import: the CPU one, as ``fixes.harness.env.setup`` would with no GPU visible; with one
    visible the server refuses to start."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        if torch.cuda.is_available():
            raise SystemExit("a GPU is visible: kernels are not forked where CUDA is in play "
                             "(CUDA does not survive a fork)")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            importlib.import_module(name)
    for name in PRELOAD_IF_PRESENT:
        try:
            importlib.import_module(name)
        except ImportError:  # an older torch: the kernel imports what it has when it needs it
            pass
    _preload_fixbook()


def _preload_fixbook() -> None:
    """Where this Python has the ``fixes`` package: import its harness and list its registry, as every notebook's
    first cells and its card do, and as each kernel's rank server imports the harness (:func:`fork_rank_server`): in a
    forked kernel, ``import fixes.harness`` took 0.072 s of CPU, and the card read every entry. Nothing is applied or
    set up: that is each notebook's own doing. Where ``fixes`` cannot be imported, the kernels import it themselves and
    show the real error."""
    try:
        import fixes
        import fixes.harness  # noqa: F401 - imported for the kernels

        fixes.available()
    except Exception:  # noqa: BLE001 - see above
        pass


def _freeze() -> None:
    """After the imports, before the first fork: the garbage collector's permanent generation takes every object
    there is (``gc.freeze``, Python's advice for a process that forks workers). A kernel's collections then skip
    torch's and DeepSpeed's module objects, instead of scanning them (and copying every page they sit on) in each
    kernel: about 0.3 s less at start and 0.25 s less at shutdown, measured with a one-cell notebook. The kernel's
    own objects are collected as in any process."""
    import gc

    gc.collect()
    gc.freeze()


class _CurrentStream:
    """``sys.stdout`` or ``sys.stderr`` as it is at each write, not as it was when a handler was made."""

    def __init__(self, name: str) -> None:
        self._name = name

    def write(self, text: str) -> int:
        return getattr(sys, self._name).write(text)

    def flush(self) -> None:
        getattr(sys, self._name).flush()

    def __getattr__(self, attribute: str):
        return getattr(getattr(sys, self._name), attribute)


def _follow_the_kernels_streams() -> None:
    """Logging handlers made at import (DeepSpeed's logger writes to ``sys.stdout``) hold the server's stdout and
    stderr; in a kernel started as a new process they are made after ipykernel has replaced both, and write into
    the notebook. Point them at whatever ``sys.stdout``/``sys.stderr`` is when they write, so that DeepSpeed's log
    lines reach the notebook's outputs here too."""
    import logging

    streams = {id(sys.stdout): "stdout", id(sys.__stdout__): "stdout", id(sys.stderr): "stderr",
               id(sys.__stderr__): "stderr"}
    loggers = [logging.getLogger(), *(logger for logger in logging.Logger.manager.loggerDict.values()
                                      if isinstance(logger, logging.Logger))]
    for logger in loggers:
        for handler in logger.handlers:
            if isinstance(handler, logging.StreamHandler) and id(handler.stream) in streams:
                handler.stream = _CurrentStream(streams[id(handler.stream)])


def _fork_resource_tracker() -> None:
    """Give this kernel the ``multiprocessing`` resource tracker its ranks report to, forked now, in a process
    group of its own. The tracker ignores SIGTERM and ends when the last process holding its pipe (the
    kernel, the ranks) has ended; in the kernel's group, ipykernel's shutdown, which signals the children in
    its group and waits until none is left, would wait for it until its manager's SIGTERM (2.5 s). Nothing is
    done where this Python's ``multiprocessing`` is not the shape this was written against."""
    import inspect
    from multiprocessing import resource_tracker

    tracker = resource_tracker._resource_tracker
    if list(inspect.signature(resource_tracker.main).parameters) != ["fd"] or \
            not all(hasattr(tracker, a) for a in ("_fd", "_pid", "_check_alive")) or tracker._fd is not None:
        return
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            os.close(write)
            resource_tracker.main(read)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(0)
    os.close(read)
    tracker._fd, tracker._pid = write, None  # as in a child of the process that started it


def fork_rank_server() -> None:
    """Give this kernel the ``multiprocessing`` forkserver that ``fixes.harness.launch`` starts its CPU ranks
    from, forked now from this process (torch and DeepSpeed already imported) instead of spawned at the
    kernel's first launch (a new Python importing both again). It is the kernel's own child, as a spawned one
    would be: it serves only this kernel and ends with it. Where this Python's ``multiprocessing`` is not the
    shape this was written against, nothing is done and the kernel spawns its forkserver as before."""
    import inspect
    from multiprocessing import connection, forkserver

    server = forkserver._forkserver
    expected = ["listener_fd", "alive_r", "preload", "main_path", "sys_path"]
    if list(inspect.signature(forkserver.main).parameters) != expected or getattr(server, "_forkserver_pid", 0) is not None \
            or not all(hasattr(server, a) for a in ("_forkserver_address", "_forkserver_alive_fd")):
        return
    address = connection.arbitrary_address("AF_UNIX")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            try:
                from fixes.harness.launch import PRELOAD as preload  # what the harness's own forkserver imports
            except ImportError:
                preload = ("torch", "deepspeed")
            forkserver.main(listener.fileno(), alive_r, list(preload))
        except SystemExit:
            pass
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
        finally:
            os._exit(0)
    listener.close()
    os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid

    def reap() -> None:
        """Reap the rank server as soon as it ends. ipykernel's shutdown signals the children in its process group
        and waits until none is left; an unreaped one would hold it until its manager's SIGTERM (2.5 s). Should
        it end while the kernel runs, the kernel's next launch starts another, as multiprocessing does for its own."""
        import threading

        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            return
        with server._lock:
            if server._forkserver_pid == pid:
                os.close(server._forkserver_alive_fd)
                server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None

    import threading

    threading.Thread(target=reap, name="fixbook-rank-server-reaper", daemon=True).start()


def start_rank_server() -> None:
    """For a process that measures entries on one release (a ``ci.sweep`` or ``ci.sweep.triggers`` child), first thing,
    before any entry runs: import what the harness's CPU ranks import (``fixes.harness.launch.PRELOAD``, the same
    modules the child's checks import), then :func:`fork_rank_server`. Its ranks are then forked from a copy of
    this process as it is now (nothing set up, no fix applied) instead of from a forkserver that starts a new
    Python and imports torch and DeepSpeed again at the first launch. A module that fails to import is left to
    the check that needs it, which shows the real error. Where the fork cannot be made, the first launch starts
    its forkserver as before."""
    from fixes.harness.launch import PRELOAD

    for name in PRELOAD:
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - see above
            pass
    try:
        fork_rank_server()
    except Exception:  # noqa: BLE001 - see above
        traceback.print_exc()


def _skip_torch_library_finalizers() -> None:
    """At the kernel's exit, before its ``atexit`` handlers: torch's operator libraries (``torch.library.Library``,
    188 of them once DeepSpeed is imported) each unregister their operators from torch's dispatcher in a
    ``weakref.finalize`` that runs at exit. The process ends right after, so that changes nothing anyone sees, and
    in a forked kernel it took 0.055 s of CPU (copying the pages it touches). Their ``atexit`` flag is cleared; every
    other finalizer and handler runs as before."""
    import weakref

    try:
        for finalizer, info in list(weakref.finalize._registry.items()):  # noqa: SLF001 - weakref's own registry
            if getattr(info.func, "__module__", None) == "torch.library":
                finalizer.atexit = False
    except Exception:  # noqa: BLE001 - another Python's weakref: every finalizer runs, as without this
        pass


def _run_kernel(request: dict, listener: socket.socket, connections: list[socket.socket]) -> None:
    """In the forked child: become the kernel of ``request``; never returns."""
    code = 1
    try:
        os.setsid()
        for sock in (listener, *connections):
            sock.close()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # What jupyter_client's launch_kernel sets for a kernel it starts, its parent's pid: ipykernel then watches
        # its parent (this server) and ends with it, and does not print its "`ipython kernel` entry point" note.
        os.environ["JPY_PARENT_PID"] = str(os.getppid())
        sys.path[0] = os.getcwd()
        # IPython's history in memory, not in the user's history.sqlite: every kernel would write its cells there,
        # two at once contending for the file's lock; a notebook's In/Out and %history work as before.
        sys.argv = ["ipykernel_launcher", *request["argv"][3:], "--HistoryManager.hist_file=:memory:"]
        _follow_the_kernels_streams()
        for fork_helper in (_fork_resource_tracker, fork_rank_server):
            try:
                fork_helper()
            except Exception:  # noqa: BLE001 - the kernel goes on; its first launch spawns these as before
                traceback.print_exc()
        import runpy

        try:
            runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        _skip_torch_library_finalizers()
        atexit._run_exitfuncs()  # what a normal interpreter exit runs (a notebook's own handlers too)
    except BaseException:  # noqa: BLE001 - reported on the kernel's stderr, then the child ends
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:
        pass  # the client has gone; its kernel is reaped all the same


def read_line(conn: socket.socket, who: str) -> tuple[bytes, bytes]:
    """One JSON line from ``conn`` (blocking), and what came after it; ConnectionError if ``who`` closes first."""
    data = b""
    while b"\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"{who} closed the connection before a whole line")
        data += chunk
    line, _, rest = data.partition(b"\n")
    return line, rest


def _read_request(conn: socket.socket, timeout: float = 10.0) -> dict:
    conn.settimeout(timeout)
    line, _ = read_line(conn, "the client")
    conn.settimeout(None)
    request = json.loads(line)
    argv = request.get("argv", [])
    if argv[1:3] != ["-m", "ipykernel_launcher"] or os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
        raise ValueError(f"this server starts only `{sys.executable} -m ipykernel_launcher ...`, not {argv}")
    return request


def _gone(parent: int) -> bool:
    """Whether the process that started this server has ended. Its parent, or, where the server was forked for it
    by another process (``ci/processes/zygote.py``), a process of that pid no longer running."""
    if os.getppid() == parent:
        return False
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def serve(path: str, idle: float, parent: int | None = None, pid_file: str | None = None) -> None:
    """Serve kernels on the Unix socket ``path`` until ``parent`` (the process that started this one, read before
    the imports: one that has gone during them counts as gone) has ended (:func:`_gone`), or ``idle``
    seconds pass with no kernel running and no request. ``pid_file``: where this process's pid is written before
    the socket appears (the process that started the server may be a stub that another process forked it for)."""
    parent = os.getppid() if parent is None else parent
    if pid_file:
        with open(pid_file + ".tmp", "w") as handle:
            handle.write(str(os.getpid()))
        os.replace(pid_file + ".tmp", pid_file)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(16)
    os.rename(path + ".tmp", path)  # the socket appears only once it accepts
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    kernels: dict[int, socket.socket] = {}
    last_active = time.monotonic()
    try:
        while True:
            for _key, _mask in selector.select(timeout=0.2):
                conn, _ = listener.accept()
                try:
                    request = _read_request(conn)
                except Exception as exc:  # noqa: BLE001 - a bad request is answered, the server goes on
                    _send(conn, {"error": f"{type(exc).__name__}: {exc}"})
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _run_kernel(request, listener, [conn, *kernels.values()])
                kernels[pid] = conn
                _send(conn, {"pid": pid})
            while kernels:  # reap every kernel that has ended and tell its client
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = kernels.pop(pid, None)
                if conn is not None:
                    _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                    conn.close()
            if kernels:
                last_active = time.monotonic()
            if _gone(parent) or (not kernels and time.monotonic() - last_active > idle):
                return
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket")
    parser.add_argument("--idle", type=float, default=60.0, help="leave after this many idle seconds")
    parser.add_argument("--parent", type=int, default=None,
                        help="the starter's pid (default: this process's parent at start): leave when it has gone")
    parser.add_argument("--pid-file", default=None, help="write this process's pid here before serving")
    args = parser.parse_args(argv)
    parent = os.getppid() if args.parent is None else args.parent
    _preload()
    _freeze()
    serve(args.socket, args.idle, parent, args.pid_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
