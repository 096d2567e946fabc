"""Watching what each rank does when a distributed job goes wrong: which rank raised what, which
finished, and which was stuck, and where.

:func:`launch` stops at the first failing rank and kills the rest, which is right for a result but
hides the shape of a hang: one rank raised, another is left waiting for it. :func:`observe_ranks`
runs the same rank function with a watchdog in every rank and returns one :class:`RankOutcome` per
rank instead of raising:

* ``finished`` — the function returned;
* ``raised`` — it raised (type, message, the last traceback lines);
* ``stalled`` — it had not returned ``stall_s`` seconds after it started: the watchdog recorded the
  rank's Python stack at that moment (what it was blocked in) and ended the process;
* ``no record`` — the rank died or was killed before it could say anything.

A rank that raised is kept alive for ``hold_s`` seconds before it returns, the way a test harness
or a launcher that does not tear the job down keeps a failed rank's process: its peers then see a
live process that will never answer (the hang), instead of a closed connection.
Everything is bounded by ``timeout``: this never hangs its caller.
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
from dataclasses import dataclass
from typing import Any, Callable

from ...exceptions import HarnessError
from ...harness.launch import launch


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    status: str  # "finished", "raised", "stalled" or "no record"
    seconds: float | None = None  # from the start of the rank function to the outcome
    error: str = ""  # "Type: message" for "raised"
    where: str = ""  # the last traceback lines ("raised") or the stack it was blocked in ("stalled")

    def frames(self, package: str = "deepspeed") -> list[str]:
        """The frames in ``where`` whose file lies in ``package``, outermost first, as
        ``"<folder>/<file>:<function>"``, e.g. ``["pipe/engine.py:_exec_send_grads", "pipe/p2p.py:send"]``."""
        found = re.findall(r'File "([^"]+)", line \d+, in (\S+)', self.where)
        return ["/".join(path.split("/")[-2:]) + f":{name}" for path, name in found if f"/{package}/" in path]

    def __str__(self) -> str:
        after = f" after {self.seconds:.1f} s" if self.seconds is not None else ""
        detail = {"raised": f": {self.error}", "stalled": " (still running: a hang)"}.get(self.status, "")
        return f"rank {self.rank}: {self.status}{after}{detail}"


def _write(path: str, record: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle)
    os.replace(path + ".tmp", path)  # a reader never sees half a record


def observed(fn: Callable[..., Any], record_dir: str, stall_s: float, hold_s: float, *args: Any) -> str:
    """Rank side of :func:`observe_ranks` (module level, so spawned ranks can unpickle it)."""
    path = os.path.join(record_dir, f"rank{os.environ.get('RANK', '0')}.json")
    started = time.monotonic()
    main = threading.main_thread().ident

    def watchdog() -> None:
        frame = sys._current_frames().get(main)
        stack = "".join(traceback.format_stack(frame)[-8:]) if frame is not None else ""
        _write(path, {"status": "stalled", "seconds": time.monotonic() - started, "where": stack})
        os._exit(3)  # a thread cannot unblock a collective; ending the process is the only way out

    timer = threading.Timer(stall_s, watchdog)
    timer.daemon = True
    timer.start()
    try:
        fn(*args)
    except BaseException as exc:  # noqa: BLE001 - recorded, it is what we came to see
        timer.cancel()
        lines = traceback.format_exc().strip().splitlines()
        _write(path, {"status": "raised", "seconds": time.monotonic() - started,
                      "error": f"{type(exc).__name__}: {exc}", "where": "\n".join(lines[-6:])})
        time.sleep(hold_s)
        return "raised"
    timer.cancel()
    _write(path, {"status": "finished", "seconds": time.monotonic() - started})
    return "finished"


def observe_ranks(fn: Callable[..., Any], world_size: int, *args: Any, stall_s: float = 20.0,
                  timeout: float = 180.0) -> list[RankOutcome]:
    """Run ``fn(*args)`` on ``world_size`` ranks (as :func:`launch` does) and say what each did.

    ``stall_s``: seconds a rank may run before it counts as stuck. ``timeout``: the bound on the
    whole call, rank start-up included (a rank that has not even started by then is "no record").
    """
    if stall_s >= timeout:
        raise ValueError(f"stall_s ({stall_s}) must be shorter than timeout ({timeout})")
    with tempfile.TemporaryDirectory(prefix="fixbook-observe-") as record_dir:
        try:
            # A rank that raised waits past its peers' stall_s, so a peer blocked on it is recorded as
            # stalled (not as a closed connection); then the launch ends on that peer's exit.
            launch(observed, world_size, fn, record_dir, stall_s, stall_s + 10, *args, timeout=timeout)
        except HarnessError:
            pass  # a stalled rank ends its process, or the timeout struck: the records say what happened
        outcomes = []
        for rank in range(world_size):
            path = os.path.join(record_dir, f"rank{rank}.json")
            if not os.path.exists(path):
                outcomes.append(RankOutcome(rank, "no record"))
                continue
            with open(path) as handle:
                record = json.load(handle)
            outcomes.append(RankOutcome(rank, record["status"], record.get("seconds"), record.get("error", ""),
                                        record.get("where", "")))
    return outcomes
