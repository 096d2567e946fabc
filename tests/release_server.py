"""A check server for one DeepSpeed release: imports torch and DeepSpeed once, then forks a fresh child
for each check it is sent, so a check no longer pays for those imports (seconds each) in a new process, nor do the
ranks it launches (their forkserver is forked from the check, :func:`_fork_rank_server`).

Started by :func:`tests.helpers.call_in_release` with the release selected (``ci.releases.environment``),
one per release, for the pytest session. Protocol, one JSON object per line:

* request on stdin: ``{"file", "function", "args", "env", "cwd", "stdout", "stderr", "timeout"}`` (``args``: the
  function's positional arguments, optional);
* reply on stdout: ``{"returncode": int}`` — 0 the check returned, 1 it raised (its traceback is in the
  ``stderr`` file), ``-N`` killed by signal N, ``"timeout"`` it ran past ``timeout`` seconds and its whole
  process group was killed.

Each child is as fresh as a new process would be, except that torch and DeepSpeed are already imported:
it is forked from a server that imported them and ran nothing else, it runs with the caller's environment
*now* (``env``), in its own process group (a timeout kills the ranks it started too), and it leaves with
``os._exit`` so interpreter teardown is not under test (see ``call_in_release``). The server never
imports an entry or applies a fix.
"""
from __future__ import annotations

import gc
import json
import os
import runpy
import signal
import sys
import time
import traceback

# torch._dynamo and Inductor: imported by ``import deepspeed`` on 0.18.3 - 0.19.7 and by a first engine build on
# 0.19.8 (about 1.7 s per process there).
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed", "fixes.harness")


def _preload() -> None:
    for module in PRELOAD:
        try:
            __import__(module)
        except Exception:  # the check imports it again and shows the real error in its own output
            pass


def _fork_rank_server() -> None:
    """Give this check the forkserver ``fixes.harness.launch`` starts its CPU ranks from, forked now (torch and
    DeepSpeed imported, nothing run) instead of spawned at its first launch as a new Python importing both again
    (seconds per check that launches ranks), as a forked kernel gets its own (``ci.processes.kernel_server``). It is this
    check's child, in its process group: a timeout ends it and the ranks with the check."""
    try:
        from ci.processes.kernel_server import fork_rank_server
    except ImportError:
        return
    fork_rank_server()


def _run_child(request: dict) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        os.setpgid(0, 0)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
        sys.stdin = open(0, closefd=False)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        _fork_rank_server()
        runpy.run_path(request["file"])[request["function"]](*request.get("args", ()))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | str:
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.02)


def serve() -> None:
    # Replies go to the original stdout alone; anything printed here (DeepSpeed logs to stdout) goes to stderr.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _preload()
    gc.collect()
    gc.freeze()  # as ci/processes/kernel_server.py does: a child's collections skip what the imports made
    for line in sys.stdin:
        request = json.loads(line)
        replies.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            replies.close()
            _run_child(request)
        try:
            os.setpgid(pid, pid)  # as the child does first: no window in which a timeout misses its group
        except OSError:
            pass
        replies.write(json.dumps({"returncode": _wait(pid, float(request["timeout"]))}) + "\n")
        replies.flush()


if __name__ == "__main__":
    serve()
