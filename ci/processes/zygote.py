"""A zygote: one Python that imports torch once and forks each per-release child the tests and the CI tools
start (a sweep child, a fingerprint observer, a check server), so that none of them imports torch again.

Importing torch with ``torch._dynamo`` and Inductor's ``compile_fx`` (what DeepSpeed imports on its newer
releases) is most of a child's start: about 6 s of CPU on 2 cores, against about 1 s more for DeepSpeed and the
harness. Every release of a sweep or a test run uses the same torch, so it is imported once, here; DeepSpeed
differs per release and is imported by the child.

A caller asks :func:`command` for the start of its argv (``[python]`` or the zygote's stub) and runs the same
``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...`` it always ran, with ``subprocess``. The stub (this file run by the caller's
Python, ``-I -S``: nothing of the project or of site-packages imported) hands the zygote its argv, environment,
working directory and its own stdin/stdout/stderr; the zygote forks a child that becomes that command:

* as ``python`` would start it: that ``__main__``, ``sys.argv``, ``sys.path`` (the working directory, ``''`` or
  the script's directory first, then the request's ``PYTHONPATH``, then the interpreter's own paths), environment, working
  directory, ``sys.dont_write_bytecode``; it leaves through ``atexit`` with the exit status ``python`` would give;
* in a process group of its own; the stub forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to that group, and when
  the stub ends first (a timeout's SIGKILL) the zygote kills the group: the child and every process it started;
* the stub exits with the child's status (a signal as that signal), so ``subprocess`` sees what it would have.

A zygote starts with the start-up variables of the commands it serves (those torch or the interpreter reads when
it starts: the prefixes in :data:`STARTUP_VARIABLES`); a command with others gets another zygote. Where a zygote
cannot serve a request exactly, the stub runs the command itself (``os.execv``), as a plain ``python`` would: its
start-up variables differ from the zygote's, the argv has other options, or the zygote is gone. What importing
torch prints goes to the zygote's own log, once, not to each command's stderr.
``FIXBOOK_ZYGOTE=0`` turns it off: :func:`command` then gives ``[python]``.
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import sys
import threading

# What torch, its libraries or the interpreter read when they start: a child needs the zygote's values of these.
STARTUP_VARIABLES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "CUDA", "CUDNN",
                     "NVIDIA", "LD_", "MALLOC", "TRITON", "INDUCTOR")
# Of those, what the child may set for itself: read later, not at start (the release's ``sys.path`` entry, which
# the child gets; where torch builds a JIT op and whether it puts ccache before the compiler, read when it builds one).
PER_CHILD = ("PYTHONPATH", "TORCH_EXTENSIONS_DIR", "TORCH_NO_COMPILER_WRAPPER")
# What the zygote imports: torch, and what ``import deepspeed`` imports on 0.18.3 - 0.19.7 (a first engine build on
# 0.19.8). A module this Python lacks is skipped.
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)

_started: dict[str, object] = {}  # "pid": whose; start-up variables (JSON) -> (the zygote's Popen, its address)
_start_lock = threading.Lock()


def _startup_environment(env: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key.startswith(STARTUP_VARIABLES) and key not in PER_CHILD}


# ---------------------------------------------------------------- caller side


def command(python: str | os.PathLike[str] | None = None, env: dict[str, str] | None = None) -> list[str]:
    """The start of the argv that runs ``python -m ...``, ``python -c ...`` or ``python SCRIPT ...`` with the
    environment ``env`` (default: this process's) forked from a zygote of this process that started with
    ``env``'s start-up variables (started on first use, at most :data:`MAX_ZYGOTES` per process, each ended with
    it). ``[python]`` where ``python`` is not this process's interpreter (another environment's venv), where
    ``FIXBOOK_ZYGOTE=0``, where that many zygotes of other start-up variables run already, or where the zygote
    did not start (a line on stderr says why)."""
    python = str(python or sys.executable)
    if python != sys.executable or os.environ.get("FIXBOOK_ZYGOTE", "1") == "0":
        return [python]
    address = _address(_startup_environment(dict(os.environ) if env is None else env))
    return [python] if address is None else [python, "-I", "-S", os.path.abspath(__file__), "run", address, "--"]


MAX_ZYGOTES = 2  # each holds torch in memory (about 0.5 GiB): a test's odd start-up variable runs as before
SHARED_VARIABLE = "FIXBOOK_ZYGOTES"  # zygotes an ancestor shares (share()): JSON {start-up variables: address}


def share(env: dict[str, str] | None = None) -> bool:
    """Start this process's zygote for ``env``'s start-up variables (default: this process's) if none runs, and
    name it in this process's environment, so that the processes it forks or starts from now on use it instead
    of each starting its own: a runner's pool of workers imports torch once, not once per worker. It stays this
    process's and ends with it; a process that outlives it starts its own. False where :func:`command` would give
    ``[python]`` (``FIXBOOK_ZYGOTE=0``, no zygote could start)."""
    if os.environ.get("FIXBOOK_ZYGOTE", "1") == "0":
        return False
    startup = _startup_environment(dict(os.environ) if env is None else env)
    address = _address(startup)
    if address is None:
        return False
    shared = _shared()
    shared[json.dumps(sorted(startup.items()))] = address
    os.environ[SHARED_VARIABLE] = json.dumps(shared)
    return True


def _shared() -> dict[str, str]:
    try:
        shared = json.loads(os.environ.get(SHARED_VARIABLE) or "{}")
    except ValueError:
        return {}
    return shared if isinstance(shared, dict) else {}


def _address(startup: dict[str, str]) -> str | None:
    import subprocess
    import tempfile

    key = json.dumps(sorted(startup.items()))
    with _start_lock:
        if _started.get("pid") != os.getpid():  # a fork of the process that started them: its zygotes are not ours
            _started.clear()
            _started["pid"] = os.getpid()
        known = _started.get(key)
        if known is not None:
            server, address = known  # type: ignore[misc]
            return address if server.poll() is None else None
        inherited = _shared().get(key)
        if isinstance(inherited, str) and os.path.exists(inherited):  # an ancestor's, while it lives (share())
            return inherited
        if len(_started) > MAX_ZYGOTES:  # the zygotes and "pid"
            return None
        scratch = tempfile.mkdtemp(prefix="fixbook-zygote-")
        address = os.path.join(scratch, "socket")
        log_path = os.path.join(scratch, "log")
        env = {key: value for key, value in os.environ.items() if not _startup_environment({key: value})
               and key not in PER_CHILD}
        env.update(startup)
        with open(log_path, "w") as log:  # its own output: what importing torch prints, once, not per child
            server = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", address], env=env,
                                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, text=True)
        ready = server.stdout.readline().strip()  # type: ignore[union-attr]
        atexit.register(_stop, server, scratch, os.getpid())
        _started[key] = (server, address)
        if ready != "ready":
            server.kill()
            server.wait()
            with open(log_path, errors="replace") as log:
                why = (log.read().strip().splitlines() or [f"exit {server.returncode}"])[-1]
            print(f"ci/processes/zygote.py: the zygote did not start ({why}); commands run as new processes", file=sys.stderr)
            return None
        return address


def _stop(server, scratch: str, owner: int) -> None:  # noqa: ANN001 - a subprocess.Popen
    import shutil
    import subprocess

    if os.getpid() != owner:  # a fork that inherited this handler: the zygote is its parent's to stop
        return
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
    shutil.rmtree(scratch, ignore_errors=True)


# ---------------------------------------------------------------- the stub (run by the caller's subprocess)


def _run_stub(address: str, args: list[str]) -> None:
    """Never returns: exits with the forked child's status, or becomes ``python ARGS`` itself."""
    request = {"args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    conn = socket.socket(socket.AF_UNIX)
    try:
        conn.connect(address)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        reader = conn.makefile("r")
        first = json.loads(reader.readline() or "{}")
    except (OSError, ValueError):
        first = {}
    if "pid" not in first:
        conn.close()
        os.execv(sys.executable, [sys.executable, *args])
    child = int(first["pid"])

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(child, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    try:
        line = reader.readline()  # a forwarded signal's handler runs, and the read goes on (PEP 475)
    except (OSError, ValueError):
        line = ""
    code = json.loads(line)["exit"] if line else 1
    if code < 0:  # as the child ended: by that signal
        _die_by(-code)
    os._exit(code)


def _die_by(signum: int) -> None:
    if signum not in (signal.SIGKILL, signal.SIGSTOP):
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


# ---------------------------------------------------------------- the zygote


def _serve(address: str) -> None:
    import importlib.util

    parent = os.getppid()  # before the imports: a starter that ends during them has ended

    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]  # this script's directory: nothing of it is imported, and no child sees it
    base_env = dict(os.environ)
    for name in PRELOAD:
        if importlib.util.find_spec(name.split(".")[0]) is not None:
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - the child imports it again and shows the real error
                pass
    import gc

    gc.collect()
    gc.freeze()  # a child's collections skip what the imports made, as in ci/processes/kernel_server.py
    startup = _startup_environment(base_env)
    base_path = list(sys.path)  # the interpreter's own paths (the zygote runs without PYTHONPATH)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen(64)
    listener.settimeout(0.05)
    running: dict[int, socket.socket] = {}  # child pid -> its stub's connection
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        while os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except (socket.timeout, InterruptedError):
                conn = None
            if conn is not None:
                _accept(conn, listener, running, startup, base_path)
            _reap(running)
    finally:
        for pid in list(running):
            _kill_group(pid)


def _accept(conn: socket.socket, listener: socket.socket, running: dict[int, socket.socket],
            startup: dict[str, str], base_path: list[str]) -> None:
    conn.settimeout(10)
    try:
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while not message.endswith(b"\n"):
            more = conn.recv(1 << 20)
            if not more:
                raise OSError("the stub left")
            message += more
        request = json.loads(message)
    except (OSError, ValueError):
        conn.close()
        return
    refusal = _refusal(request, startup, len(fds))
    if refusal:
        for fd in fds:
            os.close(fd)
        _send(conn, {"error": refusal})
        conn.close()
        return
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in running.values():
            other.close()
        conn.close()
        _become(request, fds, base_path)
    try:
        os.setpgid(pid, pid)  # as the child does first: no moment in which a kill of the group misses it
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    running[pid] = conn
    _send(conn, {"pid": pid})


def _refusal(request: dict, startup: dict[str, str], fds: int) -> str:
    args = request.get("args") or []
    if fds != 3:
        return "stdin, stdout and stderr were not passed"
    if not _forkable(args, request.get("cwd", "")):
        return "only `-m MODULE ...`, `-c CODE ...` and `SCRIPT ...` are forked"
    differs = sorted(set(startup.items()) ^ set(_startup_environment(request.get("env", {})).items()))
    return f"{differs[0][0]} differs from the zygote's" if differs else ""


def _forkable(args: list[str], cwd: str) -> bool:
    """Whether ``python ARGS`` is ``-m MODULE ...``, ``-c CODE ...`` or ``SCRIPT ...`` (no other option)."""
    if not args:
        return False
    if args[0] in ("-m", "-c"):
        return len(args) >= 2
    return not args[0].startswith("-") and os.path.isfile(os.path.join(cwd, args[0]))


def _send(conn: socket.socket, message: dict) -> None:
    """One line to a stub (a few bytes: its socket buffer takes them); the connection stays non-blocking."""
    try:
        conn.setblocking(True)
        conn.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        pass
    finally:
        conn.setblocking(False)


def _reap(running: dict[int, socket.socket]) -> None:
    for pid, conn in list(running.items()):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
            conn.close()
            del running[pid]
            continue
        try:
            gone = conn.recv(1) == b""  # the stub never writes after its request: data or EOF means it left
        except BlockingIOError:
            gone = False
        except OSError:
            gone = True
        if gone:  # the stub was killed: so is what it stood for
            _kill_group(pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _become(request: dict, fds: list[int], base_path: list[str]) -> None:
    """In the forked child: run the request's command as ``python`` would; never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        # sys.stdin, sys.stdout and sys.stderr are the zygote's, unused so far: they now read and write the new fds
        for signum in FORWARDED + (signal.SIGCHLD,):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
        args = request["args"]
        flag, first, rest = (args[0], args[1], args[2:]) if args[0] in ("-m", "-c") else ("", args[0], args[1:])
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        first_path = os.getcwd() if flag == "-m" else "" if flag == "-c" else os.path.dirname(os.path.realpath(first))
        sys.path[:] = [first_path, *extra, *base_path]
        import types

        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        try:
            if flag == "-m":
                import runpy

                sys.argv = ["-m", *rest]
                runpy._run_module_as_main(first, alter_argv=True)  # what `python -m` runs
            elif flag == "-c":
                sys.argv = ["-c", *rest]
                exec(compile(first, "<string>", "exec"), main.__dict__)
            else:
                import runpy

                sys.argv = [first, *rest]
                runpy.run_path(first, run_name="__main__")  # as `python SCRIPT` runs it
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc.code)
        except KeyboardInterrupt:
            import traceback

            traceback.print_exc()
            code = -signal.SIGINT
        except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        if code < 0:
            _die_by(-code)
        os._exit(code)


def _exit_code(value: object) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def main(argv: list[str]) -> None:
    if argv[:1] == ["run"] and len(argv) >= 3 and argv[2] == "--":
        _run_stub(argv[1], argv[3:])
    elif argv[:1] == ["serve"] and len(argv) == 2:
        _serve(argv[1])
    else:
        raise SystemExit("usage: zygote.py run ADDRESS -- ARGS... | zygote.py serve ADDRESS")


if __name__ == "__main__":
    main(sys.argv[1:])
