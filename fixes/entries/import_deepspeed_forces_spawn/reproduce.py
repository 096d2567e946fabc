"""How import-deepspeed-forces-spawn is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe.

The bug happens at ``import deepspeed``, which the sweep's process (and every kernel) did long ago. The sweep and the
trigger grid call ``set_start_method`` in a child forked from that process (:func:`chooses_in_a_child`); the notebook
and the tests run the user's whole script in a new Python (:func:`run_script`): the venv's interpreter, with the
installed DeepSpeed and this checkout on PYTHONPATH.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from ...exceptions import CannotTellError

USES = ("set-start-method",)  # what the user's script does that its config cannot show
ERROR = "RuntimeError: context has already been set"
FIX_ID = "import-deepspeed-forces-spawn"


def user_script(method: str | None = "fork", fixed: bool = False) -> str:
    """The user's script: import deepspeed, then choose a multiprocessing start method (``method``; None: choose
    none) and start a process with it. ``fixed``: ``fixes.apply()`` for this entry right after the import."""
    lines = ["import deepspeed", "import torch.multiprocessing as mp", ""]
    if fixed:
        lines[1:1] = ["import fixes", f"fixes.apply({FIX_ID!r})"]
    if method is not None:
        lines += [f"mp.set_start_method({method!r})  # the user's own choice, as in any multiprocessing script"]
    lines += ["print('start method:', mp.get_start_method())"]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class ScriptRun:
    script: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def last_line(self) -> str:
        """The script's last printed line where it ran through, else the last line of its traceback."""
        text = self.stdout if self.returncode == 0 else self.stderr
        lines = [line for line in text.strip().splitlines() if line.strip()]
        return lines[-1] if lines else ""

    @property
    def raised(self) -> bool:
        """Whether the script died on set_start_method's "context has already been set"."""
        return self.returncode != 0 and ERROR in self.output


def run_script(script: str, timeout: float = 600) -> ScriptRun:
    """``script`` in a new Python with this process's DeepSpeed and this checkout importable."""
    import deepspeed

    import fixes

    paths = [str(Path(deepspeed.__file__).resolve().parents[1]), str(Path(fixes.__file__).resolve().parents[1])]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("DS_ACCELERATOR", "cpu")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    return ScriptRun(script, done.returncode, done.stdout, done.stderr)


def chooses_in_a_child(method: str | None = "fork") -> bool:
    """This process has imported deepspeed (the sweep's, a kernel's): in a child forked from it, which inherits its
    multiprocessing state, call ``set_start_method(method)`` (None: call nothing) as the user's script would next.
    True if it raised "context has already been set"; False if it returned. Forking keeps this process's own start
    method as it is, and takes milliseconds where a new Python takes a fresh ``import deepspeed``."""
    import multiprocessing

    import deepspeed  # noqa: F401 - what the user's script did first (a no-op where it is imported)

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one byte, then leave without running any of the parent's exit handlers
        code = b"?"
        try:
            os.close(read)
            if method is not None:
                multiprocessing.set_start_method(method)
            code = b"0"
        except RuntimeError as exc:
            code = b"1" if "context has already been set" in str(exc) else b"?"
        finally:
            os.write(write, code)
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        answer = pipe.read(1)
    os.waitpid(pid, 0)
    if answer not in (b"0", b"1"):
        raise CannotTellError(f"the forked child that called set_start_method({method!r}) failed otherwise")
    return answer == b"1"


def reproduce() -> bool:
    """``import deepspeed`` then ``set_start_method('fork')`` (in a child forked from this process, which imported
    deepspeed): True if it raises ``RuntimeError: context has already been set``. The notebook runs the same
    script in a new Python (:func:`run_script`)."""
    return chooses_in_a_child("fork")


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): after ``import deepspeed``, a call to
    ``set_start_method('fork')``, and no call at all (the job only uses the start method it is given). A DeepSpeed
    config cannot show either: the use is the trigger's only condition."""
    from ...harness import Cell, trigger_job

    return [Cell("import deepspeed, then mp.set_start_method('fork')", trigger_job(None, uses=USES), reproduce),
            Cell("import deepspeed, no set_start_method call", trigger_job(None),
                 lambda: chooses_in_a_child(None), "uses:set-start-method")]
