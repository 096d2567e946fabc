"""A multi-node launch with ``deepspeed --hostfile ... --launcher openmpi``, up to the ``mpirun`` command the launcher
starts, without OpenMPI, ssh or a second machine.

:func:`launch` writes what the user has (a hostfile, a ``.deepspeed_env``, a training script), then runs the
``deepspeed`` command's own code, ``deepspeed.launcher.runner.main``, in this process with the user's arguments, in
the launch directory and with the launching shell's environment: a shell that is not itself a rank of an MPI job,
so no ``OMPI_COMM_WORLD_*`` variable (``mpirun`` sets those in the processes it starts). Its argument parsing,
hostfile, export collection and ``OpenMPIRunner`` run as they do on a cluster; only the launcher's ``subprocess`` is
replaced by a recorder while it runs, so the command it would start (``mpirun ...``, or the per-node launcher itself
on one node) is recorded, not started. ``ompi_info`` (how the launcher tells OpenMPI is installed) and ``pdsh`` only
have to exist on ``PATH``: stand-ins that are never run.

What the launch must do, whichever release: start ``mpirun`` once over the hostfile's ranks, with every variable the
user configured passed as ``-x NAME=...`` (the launching shell's forwarded ``MLFLOW_TRACKING_URI``, the
``PYTHONPATH`` DeepSpeed sets, each line of ``.deepspeed_env``, and DeepSpeed's own ``UCX_TLS``), and the training
script with its arguments. The values are not compared here: how they are quoted is another entry's matter
(launcher-mpi-exports-quoted).

(Duplicated from launcher-venv-script-drops-export's ``pdsh.py``, as each entry keeps its own recording code.)
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ...exceptions import CannotTellError

SHELL = {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"}  # forwarded: its name starts with MLFLOW
DEEPSPEED_ENV = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}  # the job's .deepspeed_env
TWO_NODES = (("node-1", 1), ("node-2", 1))  # (host, slots)
ONE_NODE = (("node-1", 1),)
NODE_PATH = "/usr/local/bin:/usr/bin:/bin"
TMP = "<tmp>"  # how the scratch directory is shown
SCRIPT = ("train.py", "--deepspeed_config", "ds_config.json")
TRAIN = """\
# the user's training script: deepspeed.initialize(...) and the training loop. The launcher never reads it, and
# nothing here runs it: mpirun would start it on every rank.
"""
STAND_IN = """\
#!/bin/sh
echo "a stand-in for {name}: the launcher only looks it up on PATH; its command is recorded, not run" >&2
exit 1
"""


@dataclass(frozen=True)
class Launch:
    """One ``deepspeed`` command: its arguments, what the launcher would start (``command``, empty where it raised
    first) or the error it raised (``error``, ``"Type: message"``)."""

    argv: tuple[str, ...]  # deepspeed's arguments as the user types them
    command: tuple[str, ...]
    error: str | None
    nodes: tuple[str, ...]
    exported: tuple[str, ...]  # the variable names the launch must pass to the ranks

    @property
    def mpirun(self) -> bool:
        return bool(self.command) and self.command[0] == "mpirun"

    def exports(self) -> dict[str, str]:
        """``-x NAME=VALUE`` of the mpirun command: {NAME: VALUE as the word has it}."""
        words = list(self.command)
        pairs = [words[at + 1] for at, word in enumerate(words[:-1]) if word == "-x"]
        return dict(pair.split("=", 1) for pair in pairs)

    def parts(self) -> dict[str, bool]:
        """What the launch must do, each: done or not (all False where the launcher raised)."""
        words, exports = list(self.command), self.exports()
        ranks = str(len(self.nodes))
        return {"mpirun is started": self.mpirun,
                f"-n {ranks} (every slot of the hostfile)": _follows(words, "-n", ranks),
                "-hostfile hostfile": _follows(words, "-hostfile", "hostfile"),
                **{f"-x {name}=...": name in exports for name in self.exported},
                "python -u " + " ".join(SCRIPT): _ends_with(words, ["-u", *SCRIPT])}

    def done(self) -> np.ndarray:
        """1.0 per part of :meth:`parts` the launch does, else 0.0."""
        return np.array([float(ok) for ok in self.parts().values()], dtype=np.float32)

    def reference(self) -> np.ndarray:
        """What :meth:`done` must be: every part."""
        return np.ones(len(self.parts()), dtype=np.float32)

    def rows(self) -> list[dict[str, str]]:
        return [{"the launch must": part, "done": "yes" if ok else "no"} for part, ok in self.parts().items()]


def _follows(words: list[str], flag: str, value: str) -> bool:
    return any(word == flag and words[at + 1] == value for at, word in enumerate(words[:-1]))


def _ends_with(words: list[str], tail: list[str]) -> bool:
    return words[-len(tail):] == tail


class _Finished:
    """What the recorder's ``Popen`` returns: a process that ended at once, with status 0."""

    returncode = 0

    def wait(self, timeout: float | None = None) -> int:
        return 0

    def poll(self) -> int:
        return 0

    def send_signal(self, sig: int) -> None:
        pass


class _Recorder:
    """Stands in for ``subprocess`` in ``deepspeed.launcher.runner`` while the launcher runs: ``Popen`` records the
    command instead of starting it; anything else is the real module's."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def Popen(self, cmd: Any, env: dict[str, str] | None = None, **kwargs: Any) -> _Finished:  # noqa: N802
        self.calls.append([str(word) for word in cmd])
        return _Finished()

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


@contextlib.contextmanager
def _as_the_deepspeed_command(environ: dict[str, str], cwd: Path) -> Iterator[_Recorder]:
    """This process as the ``deepspeed`` command would be: the launching shell's environment (only it), the launch
    directory, and the launcher's ``subprocess`` recording instead of starting. Everything is put back after:
    the environment, the directory, the launcher's module, its logger and the signal handlers it installs."""
    from deepspeed.launcher import runner
    from deepspeed.utils import logger

    saved_environ, saved_cwd = dict(os.environ), os.getcwd()
    main_thread = threading.current_thread() is threading.main_thread()
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    saved_levels = (logger.level, [handler.level for handler in logger.handlers])
    saved_subprocess = runner.subprocess
    recorder = _Recorder()

    def quiet(record: Any) -> bool:  # the launcher's INFO lines (the command among them) carry timestamps
        return False

    runner.subprocess = recorder
    logger.addFilter(quiet)
    try:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        yield recorder
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_environ)
        runner.subprocess = saved_subprocess
        logger.removeFilter(quiet)
        logger.setLevel(saved_levels[0])
        for handler, level in zip(logger.handlers, saved_levels[1]):
            handler.setLevel(level)
        if main_thread:
            for sig, handler in saved_signals.items():
                signal.signal(sig, handler)


def _write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def launch(nodes: tuple[tuple[str, int], ...] = TWO_NODES, launcher: str = "openmpi",
           options: tuple[str, ...] = ()) -> Launch:
    """``deepspeed --hostfile hostfile --master_addr <first node> --no_ssh_check --launcher <launcher> [options]
    train.py --deepspeed_config ds_config.json`` over ``nodes``, as the module docstring says. ``--no_ssh_check``:
    there is no node to reach here. An exception the launcher raises is kept in :attr:`Launch.error`."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner

    get_accelerator()  # picked now, from this process's environment, not the launching shell's below
    with tempfile.TemporaryDirectory(prefix="fixbook-launch-") as scratch:
        root = Path(scratch).resolve()
        job, home = root / "job", root / "home"
        home.mkdir()
        _write(job / "hostfile", "".join(f"{host} slots={slots}\n" for host, slots in nodes))
        _write(job / ".deepspeed_env", "".join(f"{key}={value}\n" for key, value in DEEPSPEED_ENV.items()))
        _write(job / "train.py", TRAIN)
        for name in ("ompi_info", "pdsh"):
            _write(root / "bin" / name, STAND_IN.format(name=name), 0o755)
        argv = ["--hostfile", "hostfile", "--master_addr", nodes[0][0], "--no_ssh_check", "--launcher", launcher,
                *options, *SCRIPT]
        environ = {"PATH": f"{root / 'bin'}:{NODE_PATH}", "HOME": str(home), **SHELL}
        error = None
        with _as_the_deepspeed_command(environ, job) as recorder:
            try:
                runner.main(argv)
            except (EnvironmentError, ValueError, RuntimeError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        if error is None and len(recorder.calls) != 1:
            raise CannotTellError(f"the launcher started {len(recorder.calls)} commands, not one")
        command = recorder.calls[0] if error is None else []
        shown = lambda text: text.replace(str(root), TMP).replace(sys.executable, "python")  # noqa: E731
        exported = (*SHELL, "PYTHONPATH", *DEEPSPEED_ENV, "UCX_TLS")
        return Launch(tuple(argv), tuple(shown(word) for word in command), error,
                      tuple(host for host, _ in nodes), exported)


__all__ = ["DEEPSPEED_ENV", "Launch", "ONE_NODE", "SHELL", "TWO_NODES", "launch"]
