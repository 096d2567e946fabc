"""Which DeepSpeed functions a cell runs, read while it runs: the grid's answer to "does any cell reach this code?".

Used inside one release's child (``python -m ci.differential --child`` with ``"trace"`` in its work): :func:`start`
sets a call hook (``sys.settrace`` whose global function returns None, so only calls are seen, never lines) before
the child forks its rank server, so every rank a cell launches and every process those fork inherit it. Each
process appends each DeepSpeed function it calls for the first time, as ``deepspeed/<path>.py:<qualified name>``,
to its own file in the trace folder (a forked process starts its own file and its own "seen" set). After each cell
:func:`collect` reads and removes what the cell's processes wrote. Module and class bodies are left out: they run when
a module is imported, which says nothing of what a cell reaches.
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
from pathlib import Path
from typing import Any

_MARK = "/deepspeed/"
_FUNCTION = inspect.CO_OPTIMIZED  # set for a function's code (lambdas and comprehensions too), unset for a body
_state: dict[str, Any] = {"dir": None, "seen": set(), "out": None}


def _reset() -> None:
    _state["seen"] = set()
    _state["out"] = None


def _call(frame: Any, event: str, arg: Any) -> None:
    code = frame.f_code
    seen = _state["seen"]
    if code in seen:
        return None
    seen.add(code)
    name = code.co_filename
    at = name.rfind(_MARK)
    if at < 0 or not code.co_flags & _FUNCTION:  # a module's or a class's body: an import, not a call
        return None
    out = _state["out"]
    if out is None:
        out = _state["out"] = open(Path(_state["dir"]) / f"{os.getpid()}.txt", "a", buffering=1)
    out.write(f"{name[at + 1:]}:{getattr(code, 'co_qualname', code.co_name)}\n")
    return None


def start(directory: str | Path) -> None:
    """Trace this process, every thread it starts and every process it forks from now on, into ``directory``."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    _state["dir"] = str(directory)
    os.register_at_fork(after_in_child=_reset)
    sys.settrace(_call)
    threading.settrace(_call)


def collect() -> list[str]:
    """What every traced process wrote since the last call (sorted, each once); their files are removed, and this
    process starts a fresh file and "seen" set, so the next cell's answer is its own."""
    directory = _state["dir"]
    if directory is None:
        return []
    out = _state["out"]
    if out is not None:
        out.close()
    _reset()
    found: set[str] = set()
    for path in Path(directory).glob("*.txt"):
        try:
            found.update(line for line in path.read_text().splitlines() if line)
            path.unlink()
        except OSError:  # a process still ending: what it wrote so far counts, its file goes with the next cell
            continue
    return sorted(found)
