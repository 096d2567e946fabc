"""Launching N DeepSpeed ranks from a notebook or a test, with a timeout that turns a hang into
an error.

Rank functions must live in an importable module (spawned children cannot unpickle a function
defined in a notebook cell). Results come back as numpy arrays: torch tensors sent through a
multiprocessing queue become invalid once the child that made them exits.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue as queue_module
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from ..exceptions import HarnessError, RankFailedError, RankTimeoutError
from .env import RANK_DEVICES, rank_placement

# What a CPU rank's server process imports once, so that a rank forked from it does not import them again
# (torch and DeepSpeed take seconds per process on 2 cores; the launch then costs that once per notebook).
# torch._dynamo and Inductor's compile_fx: what ``import deepspeed`` imports on 0.18.3 - 0.19.7, and a rank's first
# engine build on 0.19.8, which defers them (about 1.7 s per rank there).
PRELOAD = ("torch", "torch._dynamo", "torch._inductor.compile_fx", "deepspeed", "fixes.harness")


def to_numpy(value: Any) -> Any:
    """Tensors (also inside dicts, lists, tuples and dataclass-free containers) to numpy arrays."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().float().cpu().numpy() if value.is_floating_point() else value.cpu().numpy()
    if isinstance(value, dict):
        return {key: to_numpy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_numpy(item) for item in value)
    return value


def active_fixes() -> tuple[str, ...]:
    """The ids of the fixes applied in this process (a launched rank applies them too)."""
    from ..fix import applied_fixes

    return tuple(fix.id for fix in applied_fixes())


def start_method(accelerator: str, why: str) -> str:
    """How a launch starts its ranks. ``forkserver`` where every rank runs on CPU as this process does:
    each rank is forked from a server process that has imported :data:`PRELOAD` and run nothing else, so
    it is as fresh as a spawned one (no DeepSpeed state, no fix applied, this process's environment) without
    importing torch and DeepSpeed again. ``spawn`` where CUDA is in play (a GPU here, or ranks moved to CPU
    because there are fewer GPUs than ranks): the server's DeepSpeed would already have picked its
    accelerator, and CUDA does not survive a fork. ``FIXBOOK_START_METHOD=spawn`` in the environment forces
    ``spawn`` everywhere (how ``python -m ci.bench --section launch`` measures the difference)."""
    if os.environ.get("FIXBOOK_START_METHOD") == "spawn":
        return "spawn"
    return "forkserver" if accelerator == "cpu" and not why and "forkserver" in mp.get_all_start_methods() else "spawn"


def _context(method: str) -> Any:
    context = mp.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(PRELOAD))  # read once, when the server starts
    return context


def _capture(path: str) -> None:
    """This rank's output, Python's and its file descriptors' (a C library's, DeepSpeed's logger), into ``path``:
    the launcher relays it to whoever launched the rank (a notebook cell), not to the terminal a server started in."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a stream of the parent's that this process cannot use
            pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)


def _relay(outputs: list[str]) -> None:
    """Each rank's output, rank by rank, each line as ``[rankN] ...`` (torchrun's own prefix), into this process's
    ``sys.stdout``; then the files go."""
    for rank, path in enumerate(outputs):
        try:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
        except OSError:
            continue
        finally:
            with contextlib.suppress(OSError):
                os.unlink(path)
        lines = [line for line in text.splitlines() if line.strip()]
        if lines:
            print("\n".join(f"[rank{rank}] {line}" for line in lines), flush=True)


def _rank_main(rank: int, world_size: int, meeting: "Rendezvous", fn: Callable[..., Any], args: tuple[Any, ...],
               results: "mp.Queue[tuple[Any, ...]]", applied: tuple[str, ...] = (), on_cpu: bool = False,
               environ: dict[str, str] | None = None, output: str | None = None) -> None:
    if output is not None:
        _capture(output)
    if environ is not None:  # the launching process's environment now, not the server's from when it started
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(meeting.environ(rank, world_size))
    try:
        from .env import setup, use_cpu_only

        if on_cpu:
            use_cpu_only()

        setup()
        if applied:
            from .. import registry

            registry.apply(*applied)
        results.put(("ok", rank, to_numpy(fn(*args))))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
        results.put(("error", rank, type(exc).__name__, str(exc), traceback.format_exc()))


@dataclass(frozen=True)
class Rendezvous:
    """Where one launch's ranks meet: a ``TCPStore`` that the launching process hosts on ``port``."""

    port: int

    def environ(self, rank: int, world_size: int) -> dict[str, str]:
        """The variables that make ``rank``'s ``env://`` rendezvous (``init_process_group``, DeepSpeed's
        ``init_distributed``) a client of this store: torchrun's own arrangement, where its agent hosts the store
        (``TORCHELASTIC_USE_AGENT_STORE``) and no rank binds a port."""
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


@contextlib.contextmanager
def rendezvous() -> Iterator[Rendezvous]:
    """A ``TCPStore`` served from this process, for one launch, on a port the system picks and this process holds
    until the ranks are done.

    Rank 0 hosting the store on a port that was free a moment before (a ``free_port()``) lets two launches on one
    machine meet: between the choice and rank 0's bind, another launch can get the same port, and a rank that
    connects first joins the other launch's store; the ranks then exchange gradients with strangers (a wrong
    result) or lose a connection (``Gloo connectFullMesh failed``). A port held from the moment it is chosen
    belongs to this launch alone."""
    import datetime

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    try:
        yield Rendezvous(int(store.port))
    finally:
        del store  # its server stops: the port is free again


def launch(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes, each an initialised DeepSpeed rank
    (started as :func:`start_method` says).

    Every fix applied in the calling process is applied in each rank before ``fn`` runs: a rank
    runs the DeepSpeed its launcher sees. One GPU per rank: with fewer GPUs than ranks every rank
    runs on CPU (gloo), and a line says so (:func:`fixes.harness.env.rank_placement`). Returns the per-rank results (numpy) in rank order. Raises RankFailedError with the first
    failing rank's exception type, message and traceback (or its exit signal if it died without
    one, e.g. a segfault), and RankTimeoutError if the ranks have not all finished within
    ``timeout`` seconds; in both cases every rank is killed first. The ranks meet at a store this process
    serves for the launch (:func:`rendezvous`), so launches running side by side never meet each other's ranks.
    """
    if getattr(fn, "__module__", "__main__") == "__main__":
        raise HarnessError(f"{fn!r} is defined in __main__ (a notebook cell?); rank functions must live in "
                           "an importable module")
    accelerator, why = rank_placement(world_size)
    if why:
        print(why, flush=True)
    RANK_DEVICES.add(accelerator)
    context = _context(start_method(accelerator, why))
    applied = active_fixes()
    with rendezvous() as meeting:
        return _launch_once(context, fn, world_size, args, timeout, applied, accelerator, meeting)


def _launch_once(context: Any, fn: Callable[..., Any], world_size: int, args: tuple[Any, ...], timeout: float,
                 applied: tuple[str, ...], accelerator: str, meeting: Rendezvous) -> list[Any]:
    """:func:`launch`'s ranks, meeting at ``meeting``; every rank is killed before it returns."""
    results = context.Queue()
    scratch = tempfile.mkdtemp(prefix="fixbook-ranks-")
    outputs = [os.path.join(scratch, f"rank{rank}.out") for rank in range(world_size)]
    procs = [context.Process(target=_rank_main, args=(rank, world_size, meeting, fn, args, results, applied,
                                                      accelerator == "cpu", dict(os.environ), outputs[rank]),
                             daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    done: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(done) < world_size:
            try:
                message = results.get(timeout=0.2)
            except queue_module.Empty:
                _raise_if_died(procs, done)
                if time.monotonic() > deadline:
                    raise RankTimeoutError(timeout, sorted(done), world_size) from None
                continue
            if message[0] == "error":
                _, rank, exc_type, text, trace = message
                raise RankFailedError(rank, exc_type, text, trace)
            done[message[1]] = message[2]
    finally:
        _stop(procs)
        _relay(outputs)
        with contextlib.suppress(OSError):
            os.rmdir(scratch)
    return [done[rank] for rank in range(world_size)]


def _raise_if_died(procs: list[Any], done: dict[int, Any]) -> None:
    for rank, proc in enumerate(procs):
        if rank not in done and proc.exitcode is not None and proc.exitcode != 0:
            name = signal.Signals(-proc.exitcode).name if proc.exitcode < 0 else f"exit code {proc.exitcode}"
            raise RankFailedError(rank, "ProcessDied", f"the process died ({name}) without reporting", "")


def _stop(procs: list[Any]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)
