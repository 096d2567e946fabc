"""A multi-node launch with ``deepspeed --hostfile ... --launcher <openmpi|mpich|impi|mvapich|pdsh>``, up to the
command the launcher starts, and the environment every rank would start with, without MPI, pdsh, ssh or a second
machine.

:func:`launch` writes what the user has (a hostfile, a ``.deepspeed_env``, a training script), then runs the
``deepspeed`` command's own code, ``deepspeed.launcher.runner.main``, in this process with the user's arguments, in
the launch directory and with the launching shell's environment. Its argument parsing, hostfile, export collection
and runner run as they do on a cluster; only the launcher's ``subprocess`` is replaced by a recorder while it runs,
so the command it would start is recorded, not started. The programs the launcher looks up on ``PATH`` to tell the
backend is installed (``ompi_info``, ``mpirun``, ``mpiname``, ``pdsh``) are stand-ins that are never run.

What a rank would see of each variable, from the recorded command:

* an MPI launcher gets the command as a list of words, with no shell between: ``mpirun`` sets each variable to the
  text of its word as it is. OpenMPI's ``-x NAME=VALUE`` sets NAME to everything after the first ``=``; the Hydra
  process manager (MPICH's ``mpirun``, which Intel MPI's and MVAPICH2-GDR's are built on) takes ``-genv``/``-env``
  ``NAME=VALUE`` as one word, or ``NAME VALUE`` as two. Quotes in the word are part of the value. (Checked, when this
  entry was written, with Debian's OpenMPI 4.1 and MPICH 4.0 ``mpirun`` on one machine: ``-x 'K="v"'``,
  ``-genv K '"v"'``, ``-genv 'K="v"'`` and ``-env 'K="v"'`` all give the ranks ``"v"``, quotes included.)
* pdsh runs the words after its own options, joined by spaces, in a shell on every node: here that line runs in
  ``bash -c`` up to where it starts ``deepspeed.launcher.launch``, and a Python prints the environment it started
  with instead (the shell removes the quotes).
* on one node the launcher starts ``deepspeed.launcher.launch`` itself, with its own environment.

The reference is the environment the user configured, which every rank must see: the launching shell's variable
DeepSpeed forwards (here ``MLFLOW_TRACKING_URI``), the ``PYTHONPATH`` DeepSpeed sets to the launch directory (over
several nodes), and each line of ``.deepspeed_env``.

(Duplicated in part from launcher-venv-script-drops-export's ``pdsh.py``, as each entry keeps its own recording code.)
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
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
MPI_LAUNCHERS = ("openmpi", "mpich", "impi", "mvapich")
NODE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a node's login PATH
LAUNCH = "-u -m deepspeed.launcher.launch"  # what follows the Python in pdsh's line
TMP = "<tmp>"  # how the scratch directory is shown
SCRIPT = ("train.py", "--deepspeed_config", "ds_config.json")
_DUMP = "import json, os; print(json.dumps(dict(os.environ)))"
TRAIN = """\
# the user's training script: deepspeed.initialize(...) and the training loop. The launcher never reads it, and
# nothing here runs it: what it would see of the environment is what the launcher hands each rank.
"""
STAND_IN = """\
#!/bin/sh
# a stand-in for {name}: the launcher only looks it up on PATH (mvapich's also asks it its name); never started
echo "{answer}"
"""
_ANSWERS = {"mpiname": "MVAPICH2-GDR 2.3.7"}  # the MVAPICH runner requires MVAPICH2-GDR
_ENV_FLAGS = {"openmpi": ("-x",), "mpich": ("-genv", "-env"), "impi": ("-genv", "-env"), "mvapich": ("-genv", "-env")}
_MVAPICH_HOSTFILE = "/tmp/deepspeed_mvapich_hostfile"  # DeepSpeed's MVAPICH runner writes it (constants.py)


@dataclass(frozen=True)
class Launch:
    """One ``deepspeed`` command, what the launcher would start, and what a rank would see of each configured
    variable."""

    launcher: str  # --launcher
    argv: tuple[str, ...]  # deepspeed's arguments as the user types them
    command: tuple[str, ...]  # what the launcher would start
    nodes: tuple[str, ...]
    expected: dict[str, str]  # the environment the user configured, which every rank must see
    seen: dict[str, str | None]  # each expected variable as a rank sees it

    @property
    def started(self) -> str:
        """What the launcher starts: ``mpirun``, ``pdsh``, or the per-node launcher (one node)."""
        return {"mpirun": "mpirun", "pdsh": "pdsh"}.get(self.command[0], "deepspeed.launcher.launch")

    @property
    def wrong(self) -> list[str]:
        """The configured variables a rank does not see as configured."""
        return [key for key, value in self.expected.items() if self.seen.get(key) != value]

    def reached(self) -> np.ndarray:
        """[variable]: 1.0 where a rank sees the variable with its configured value, else 0.0."""
        return np.array([float(self.seen.get(key) == value) for key, value in self.expected.items()],
                        dtype=np.float32)

    def reference(self) -> np.ndarray:
        """What :meth:`reached` must be: every configured variable as configured."""
        return np.ones(len(self.expected), dtype=np.float32)

    def words(self) -> list[str]:
        """The words of the command that carry the configured variables."""
        words = list(self.command)
        if self.started == "pdsh":
            return [word for word in words if word.startswith("export ")]
        found = []
        for at, word in enumerate(words[:-1]):
            if word in _ENV_FLAGS.get(self.launcher, ()):
                value = words[at + 1]
                name = value.split("=", 1)[0] if "=" in value else value
                if name in self.expected:
                    found += [word, value] if "=" in value else [word, value, words[at + 2]]
        return found

    def rows(self) -> list[dict[str, str]]:
        """One row per configured variable: its value, and what a rank sees (repr: quotes show)."""
        return [{"variable": key, "configured": repr(value), "a rank sees": _shown(self.seen.get(key))}
                for key, value in self.expected.items()]


def _shown(value: str | None) -> str:
    return "(not set)" if value is None else repr(value)


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
    command and its environment instead of starting it; anything else is the real module's."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def Popen(self, cmd: Any, env: dict[str, str] | None = None, **kwargs: Any) -> _Finished:  # noqa: N802
        self.calls.append(([str(word) for word in cmd], dict(env if env is not None else os.environ)))
        return _Finished()

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)


@contextlib.contextmanager
def _as_the_deepspeed_command(environ: dict[str, str], cwd: Path) -> Iterator[_Recorder]:
    """This process as the ``deepspeed`` command would be: the launching shell's environment (only it), the launch
    directory, and the launcher's ``subprocess`` recording instead of starting. Everything is put back after:
    the environment, the directory, the launcher's module, its logger, the signal handlers it installs, stdout (the
    Intel MPI runner prints its command) and the hostfile the MVAPICH runner writes."""
    from deepspeed.launcher import runner
    from deepspeed.utils import logger

    saved_environ, saved_cwd = dict(os.environ), os.getcwd()
    main_thread = threading.current_thread() is threading.main_thread()
    saved_signals = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    saved_levels = (logger.level, [handler.level for handler in logger.handlers])
    saved_subprocess = runner.subprocess
    mvapich_hostfile = Path(_MVAPICH_HOSTFILE)
    saved_hostfile = mvapich_hostfile.read_bytes() if mvapich_hostfile.is_file() else None
    recorder = _Recorder()

    def quiet(record: Any) -> bool:  # the launcher's INFO lines (the command among them) carry timestamps
        return False

    runner.subprocess = recorder
    logger.addFilter(quiet)
    try:
        os.environ.clear()
        os.environ.update(environ)
        os.chdir(cwd)
        with contextlib.redirect_stdout(open(os.devnull, "w")):
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
        if saved_hostfile is None:
            mvapich_hostfile.unlink(missing_ok=True)
        else:
            mvapich_hostfile.write_bytes(saved_hostfile)


def _write(path: Path, text: str, mode: int = 0o644) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


def launch(nodes: tuple[tuple[str, int], ...] = TWO_NODES, launcher: str = "openmpi") -> Launch:
    """``deepspeed --hostfile hostfile --master_addr <first node> --no_ssh_check --launcher <launcher> train.py
    --deepspeed_config ds_config.json`` over ``nodes``, as the module docstring says. ``--no_ssh_check``: there is
    no node to reach here."""
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
        for name in ("ompi_info", "mpirun", "mpiname", "pdsh"):
            _write(root / "bin" / name, STAND_IN.format(name=name, answer=_ANSWERS.get(name, "")), 0o755)
        argv = ["--hostfile", "hostfile", "--master_addr", nodes[0][0], "--no_ssh_check", "--launcher", launcher,
                *SCRIPT]
        environ = {"PATH": f"{root / 'bin'}:{NODE_PATH}", "HOME": str(home), **SHELL}
        with _as_the_deepspeed_command(environ, job) as recorder:
            runner.main(argv)
        if len(recorder.calls) != 1:
            raise CannotTellError(f"the launcher started {len(recorder.calls)} commands, not one")
        command, environment = recorder.calls[0]
        if command[0] == "pdsh":
            seen = _pdsh_rank_environment(command, home)
        elif command[0] == "mpirun":
            seen = _mpirun_rank_environment(command, _ENV_FLAGS[launcher])
        else:  # one node: the launcher starts deepspeed.launcher.launch itself, with its own environment
            seen = environment
        expected = {**SHELL, **({"PYTHONPATH": str(job), **DEEPSPEED_ENV} if command[0] != sys.executable else {})}
        shown = lambda text: text.replace(str(root), TMP).replace(sys.executable, "python")  # noqa: E731
        return Launch(launcher, tuple(argv), tuple(shown(word) for word in command), tuple(h for h, _ in nodes),
                      {key: shown(value) for key, value in expected.items()},
                      {key: None if seen.get(key) is None else shown(seen[key]) for key in expected})


def _mpirun_rank_environment(command: list[str], flags: tuple[str, ...]) -> dict[str, str]:
    """The variables ``mpirun`` sets in every rank from its command line, as the module docstring says: each word
    after one of ``flags``, ``NAME=VALUE`` (split at the first ``=``) or ``NAME VALUE``, taken as it is."""
    environment: dict[str, str] = {}
    at = 0
    while at < len(command) - 1:
        if command[at] in flags:
            word = command[at + 1]
            if "=" in word:
                name, value = word.split("=", 1)
                at += 2
            else:
                name, value = word, command[at + 2]
                at += 3
            environment[name] = value
        else:
            at += 1
    return environment


def _pdsh_rank_environment(command: list[str], home: Path) -> dict[str, str]:
    """pdsh's line for the first node, run as its shell would, in ``bash -c`` from the node's home with only its
    login variables, up to where it starts DeepSpeed's per-node launcher; in its place a Python prints the
    environment it starts with, which that launcher hands every rank."""
    at = command.index("-w")
    line = " ".join(command[at + 2:]).replace("%n", "0")
    launcher = f"{sys.executable} {LAUNCH}"
    if launcher not in line:
        raise CannotTellError(f"no `{launcher}` in the node's line: {line}")
    script = line[:line.index(launcher)] + f"{shlex.quote(sys.executable)} -c {shlex.quote(_DUMP)}"
    try:
        done = subprocess.run(["bash", "-c", script], env={"PATH": NODE_PATH, "HOME": str(home)}, cwd=home,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CannotTellError(f"the node's shell did not run: {type(exc).__name__}: {exc}") from exc
    if done.returncode != 0:
        raise CannotTellError(f"the node's shell failed (exit {done.returncode}): {done.stderr[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


__all__ = ["DEEPSPEED_ENV", "Launch", "MPI_LAUNCHERS", "ONE_NODE", "SHELL", "TWO_NODES", "launch"]
