"""Watching what each rank does when a distributed job goes wrong: which rank raised what, which
finished, and which was stuck, and where.

:func:`launch` stops at the first failing rank and kills the rest, which is right for a result but
hides the shape of a hang: one rank raised, another is left waiting for it. :func:`observe_ranks`
runs the same rank function with a watchdog in every rank and returns one :class:`RankOutcome` per
rank instead of raising:

* ``finished`` — the function returned (its result is the outcome's ``result``);
* ``raised`` — it raised (type, message, the last traceback lines);
* ``stalled`` — it had not returned, and the watchdog recorded the rank's Python stack (what it was
  blocked in) and ended the process: either ``stall_s`` seconds after it started, or earlier, once
  another rank had raised and this one then sat ``blocked_s`` seconds in one call without running
  (the same Python stack at every look, no CPU time used: waiting on something, such as the rank that
  raised, not computing; a loaded machine only delays this verdict);
* ``no record`` — the rank died or was killed before it could say anything.

A rank that raised is kept alive until every other rank has recorded its outcome (at most ``hold_s``
seconds), the way a test harness or a launcher that does not tear the job down keeps a failed rank's
process: its peers then see a live process that will never answer (the hang), instead of a closed
connection. Everything is bounded by ``timeout``: this never hangs its caller.
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from ...exceptions import HarnessError
from ...harness.launch import launch

LOOK_S = 0.05  # how often a rank's watchdog looks at the rank (and a rank that raised at its peers' records)
LOOKS = 10  # the fewest looks, each after a pause in which the rank could have run, that make it "blocked"
IDLE_CPU_S = 0.005  # the most CPU time a rank may use over ``blocked_s`` and still count as waiting


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    status: str  # "finished", "raised", "stalled" or "no record"
    seconds: float | None = None  # from the start of the rank function to the outcome
    error: str = ""  # "Type: message" for "raised"
    where: str = ""  # the last traceback lines ("raised") or the stack it was blocked in ("stalled")
    why: str = ""  # for "stalled": what made the watchdog call it stuck
    result: Any = field(default=None, repr=False, compare=False)  # for "finished": what the function returned

    def frames(self, package: str = "deepspeed") -> list[str]:
        """The frames in ``where`` whose file lies in ``package``, outermost first, as
        ``"<folder>/<file>:<function>"``, e.g. ``["pipe/engine.py:_exec_send_grads", "pipe/p2p.py:send"]``."""
        found = re.findall(r'File "([^"]+)", line \d+, in (\S+)', self.where)
        return ["/".join(path.split("/")[-2:]) + f":{name}" for path, name in found if f"/{package}/" in path]

    def __str__(self) -> str:
        after = f" after {self.seconds:.1f} s" if self.seconds is not None else ""
        stalled = f" (still running: a hang; {self.why})" if self.why else " (still running: a hang)"
        detail = {"raised": f": {self.error}", "stalled": stalled}.get(self.status, "")
        return f"rank {self.rank}: {self.status}{after}{detail}"


def _write(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)  # a reader never sees half a record


def _read(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def _peers(record_dir: str, rank: int) -> list[str]:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return [os.path.join(record_dir, f"rank{peer}.json") for peer in range(world_size) if peer != rank]


def _position(frame: Any) -> tuple[tuple[Any, int], ...]:
    """Where a thread is: its frames' code and line, innermost first (holds no frame)."""
    position = []
    while frame is not None:
        position.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(position)


def _cpu_clock(thread: threading.Thread) -> Callable[[], float | None]:
    """The CPU seconds ``thread`` has used so far, as a function; it answers ``None`` where the platform cannot say."""
    try:
        clock = time.pthread_getcpuclockid(thread.ident)  # type: ignore[arg-type]
        time.clock_gettime(clock)
    except (AttributeError, OSError, TypeError):
        return lambda: None
    return lambda: time.clock_gettime(clock)


def observed(fn: Callable[..., Any], record_dir: str, stall_s: float, hold_s: float, blocked_s: float,
             *args: Any) -> Any:
    """Rank side of :func:`observe_ranks` (module level, so spawned ranks can unpickle it)."""
    rank = int(os.environ.get("RANK", "0"))
    path = os.path.join(record_dir, f"rank{rank}.json")
    peers = _peers(record_dir, rank)
    started = time.monotonic()
    main = threading.main_thread()
    cpu = _cpu_clock(main)
    verdict = threading.Lock()  # taken by whichever comes first: the function's end or the watchdog's "stalled"
    ended = threading.Event()

    def watchdog() -> None:
        raised_peer = None  # the first peer seen to have raised
        looks: list[tuple[float, Any, float | None]] = []  # (time, position, CPU seconds) since it last moved
        while True:
            now = time.monotonic()
            if now - started >= stall_s:
                why = f"not returned within {stall_s:g} s"
                break
            if raised_peer is None:
                raised_peer = next((peer for peer in peers if (_read(peer) or {}).get("status") == "raised"), None)
            if raised_peer is not None:
                look = (now, _position(sys._current_frames().get(main.ident)), cpu())
                if looks and looks[-1][1] != look[1]:
                    looks = []  # it moved: start over
                looks.append(look)
                first, cpu_used = looks[0], (None if look[2] is None or looks[0][2] is None else look[2] - looks[0][2])
                if (len(looks) >= LOOKS and now - first[0] >= blocked_s
                        and (cpu_used is None or cpu_used <= IDLE_CPU_S)):
                    peer = re.search(r"rank(\d+)\.json$", raised_peer).group(1)  # type: ignore[union-attr]
                    why = f"rank {peer} raised, then this rank sat in one call for {now - first[0]:.1f} s"
                    if cpu_used is not None:
                        why += f" using {cpu_used * 1000:.0f} ms of CPU"
                    break
            if ended.wait(LOOK_S):
                return
        if not verdict.acquire(blocking=False):
            return  # the function ended first
        frame = sys._current_frames().get(main.ident)
        stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else ""
        _write(path, {"status": "stalled", "seconds": time.monotonic() - started, "where": stack, "why": why})
        os._exit(3)  # a thread cannot unblock a collective; ending the process is the only way out

    threading.Thread(target=watchdog, name="observe-watchdog", daemon=True).start()
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - recorded, it is what we came to see
        verdict.acquire()  # if the watchdog has it, the process is ending
        ended.set()
        lines = traceback.format_exc().strip().splitlines()
        _write(path, {"status": "raised", "seconds": time.monotonic() - started,
                      "error": f"{type(exc).__name__}: {exc}", "where": "\n".join(lines[-6:])})
        until = time.monotonic() + hold_s  # alive until every peer has said what it did
        while time.monotonic() < until and not all(os.path.exists(peer) for peer in peers):
            time.sleep(LOOK_S)
        return None
    verdict.acquire()
    ended.set()
    _write(path, {"status": "finished", "seconds": time.monotonic() - started})
    return result


def observe_ranks(fn: Callable[..., Any], world_size: int, *args: Any, stall_s: float = 20.0,
                  timeout: float = 180.0, blocked_s: float = 1.0) -> list[RankOutcome]:
    """Run ``fn(*args)`` on ``world_size`` ranks (as :func:`launch` does) and say what each did.

    ``stall_s``: seconds a rank may run before it counts as stuck. ``blocked_s``: once another rank has
    raised, seconds a rank may sit in one call without using the CPU before it counts as stuck.
    ``timeout``: the bound on the whole call, rank start-up included (a rank that has not even started
    by then is "no record"). Where every rank finished, each outcome's ``result`` is what ``fn`` returned there.
    """
    if stall_s >= timeout:
        raise ValueError(f"stall_s ({stall_s}) must be shorter than timeout ({timeout})")
    results: list[Any] = [None] * world_size
    with tempfile.TemporaryDirectory(prefix="fixbook-observe-") as record_dir:
        try:
            # A rank that raised waits until its peers have recorded (at most past their stall_s), so a peer
            # blocked on it is recorded as stalled (not as a closed connection); then the launch ends.
            results = launch(observed, world_size, fn, record_dir, stall_s, stall_s + 10, blocked_s, *args,
                             timeout=timeout)
        except HarnessError:
            pass  # a stalled rank ends its process, or the timeout struck: the records say what happened
        outcomes = []
        for rank in range(world_size):
            record = _read(os.path.join(record_dir, f"rank{rank}.json"))
            if record is None:
                outcomes.append(RankOutcome(rank, "no record"))
                continue
            outcomes.append(RankOutcome(rank, record["status"], record.get("seconds"), record.get("error", ""),
                                        record.get("where", ""), record.get("why", ""),
                                        results[rank] if record["status"] == "finished" else None))
    return outcomes
