"""A multi-node launch with ``deepspeed --hostfile ... --venv_script ...``, up to the point where each node starts
DeepSpeed's per-node launcher, without pdsh, ssh or a second machine.

:func:`launch` writes what the user has (a hostfile, a ``.deepspeed_env``, a virtual environment's activation
script, a training script), then runs the ``deepspeed`` command's own code, ``deepspeed.launcher.runner.main``, in
this process with the user's arguments, in the launch directory and with the launching shell's environment. Its
argument parsing, hostfile, export collection and ``PDSHRunner`` run as they do on a cluster; only the launcher's
``subprocess`` is replaced by a recorder while it runs, so the command it would start (``pdsh ...``, or the
per-node launcher itself on one node) is recorded, not started. ``pdsh`` only has to exist on ``PATH`` for the
launcher to pick it: a stand-in that is never run.

pdsh runs the words after its own options, joined by spaces, in a shell on every node (``%n`` becomes the node's
rank). Here each node's line runs in ``bash -c`` on this machine, with a node's login environment (``PATH``,
``HOME``) and nothing else, up to ``python -u -m deepspeed.launcher.launch``; in its place a Python prints the
environment it started with. That is the environment the node's ``deepspeed.launcher.launch`` starts with, and it
hands a copy of it to every rank it starts.

The reference is the environment the user configured, which every node must see: the launching shell's variables
DeepSpeed forwards (here ``MLFLOW_TRACKING_URI``), the ``PYTHONPATH`` DeepSpeed itself sets to the launch directory,
each line of ``.deepspeed_env``, and what the activation script sets (``VIRTUAL_ENV``).
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

# The launching shell's own variables: DeepSpeed forwards those whose names start with its EXPORT_ENVS prefixes
# (MLFLOW, PYTHON, MV2, UCX, and on CUDA NCCL).
SHELL = {"MLFLOW_TRACKING_URI": "http://mlflow.internal:5000"}
# The job's .deepspeed_env: the documented way to set variables on every node.
DEEPSPEED_ENV = {"NCCL_SOCKET_IFNAME": "eth0", "NCCL_IB_DISABLE": "1"}
TWO_NODES = (("node-1", 1), ("node-2", 1))  # (host, slots)
ONE_NODE = (("node-1", 1),)
NODE_PATH = "/usr/local/bin:/usr/bin:/bin"  # a node's login PATH
LAUNCH = "-u -m deepspeed.launcher.launch"  # what follows the Python in each node's line
TMP = "<tmp>"  # how the scratch directory is shown
_DUMP = "import json, os; print(json.dumps(dict(os.environ)))"
ACTIVATE = """\
# the job's virtual environment, what `python -m venv` writes (shortened)
export VIRTUAL_ENV={venv}
export PATH="$VIRTUAL_ENV/bin:$PATH"
"""
TRAIN = """\
# the user's training script: deepspeed.initialize(...) and the training loop. The launcher never reads it, and
# nothing here runs it: what it would see of the environment is what each node's launcher starts with.
"""
PDSH = """\
#!/bin/sh
echo "a stand-in for pdsh: the launcher only looks it up on PATH; its command is recorded, not run" >&2
exit 1
"""


@dataclass(frozen=True)
class Launch:
    """One ``deepspeed`` command, as the launcher would run it, and the environment each node starts with."""

    argv: tuple[str, ...]  # deepspeed's arguments as the user types them
    command: tuple[str, ...]  # what the launcher would start
    nodes: tuple[str, ...]
    lines: tuple[str, ...]  # pdsh: the line each node's shell runs; one node: the command, as the launcher runs it
    expected: dict[str, str]  # the environment the user configured, which every node must see
    seen: tuple[dict[str, str | None], ...]  # per node: each expected variable as that node's launcher sees it

    @property
    def pdsh(self) -> bool:
        return self.command[0] == "pdsh"

    @property
    def lost(self) -> dict[str, list[str]]:
        """{node: the configured variables it does not see as configured} (empty lists where all arrive)."""
        return {node: [key for key, value in self.expected.items() if seen.get(key) != value]
                for node, seen in zip(self.nodes, self.seen)}

    @property
    def any_lost(self) -> bool:
        return any(self.lost.values())

    def reached(self) -> np.ndarray:
        """[node, variable]: 1.0 where the node sees the variable with its configured value, else 0.0."""
        return np.array([[float(seen.get(key) == value) for key, value in self.expected.items()] for seen in self.seen],
                        dtype=np.float32)

    def reference(self) -> np.ndarray:
        """What :meth:`reached` must be: every configured variable on every node."""
        return np.ones((len(self.nodes), len(self.expected)), dtype=np.float32)

    def rows(self) -> list[dict[str, str]]:
        """One row per configured variable: its value, and what each node sees."""
        return [{"variable": key, "configured": value,
                 **{node: _shown(seen.get(key)) for node, seen in zip(self.nodes, self.seen)}}
                for key, value in self.expected.items()]


def _shown(value: str | None) -> str:
    return "(not set)" if value is None else value


def has_venv_script() -> bool:
    """Whether the installed launcher takes ``--venv_script`` (it first appeared in 0.17.1)."""
    from deepspeed.launcher import runner

    return hasattr(runner.parse_args(["train.py"]), "venv_script")


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
        logger.setLevel(saved_levels[0])  # 0.19.8's main sets the level from --log_level
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


def launch(nodes: tuple[tuple[str, int], ...] = TWO_NODES, venv_script: bool = True, force_multi: bool = False,
           shell: dict[str, str] | None = None) -> Launch:
    """``deepspeed --hostfile hostfile --master_addr <first node> --no_ssh_check --launcher pdsh [--venv_script
    <venv>/bin/activate] train.py --deepspeed_config ds_config.json`` over ``nodes``, as the module docstring says.
    ``--no_ssh_check``: there is no node to reach here (on a cluster the launcher first checks that ssh works).
    ``shell``: the launching shell's own variables (default :data:`SHELL`)."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher import runner

    shell_vars = dict(SHELL if shell is None else shell)
    get_accelerator()  # picked now, from this process's environment, not the launching shell's below
    if venv_script and not has_venv_script():
        raise ValueError("this DeepSpeed's launcher has no --venv_script")
    with tempfile.TemporaryDirectory(prefix="fixbook-launch-") as scratch:
        root = Path(scratch).resolve()
        job, home, venv = root / "job", root / "home", root / "venv"
        home.mkdir()
        _write(job / "hostfile", "".join(f"{host} slots={slots}\n" for host, slots in nodes))
        _write(job / ".deepspeed_env", "".join(f"{key}={value}\n" for key, value in DEEPSPEED_ENV.items()))
        _write(job / "train.py", TRAIN)
        activate = _write(venv / "bin" / "activate", ACTIVATE.format(venv=venv))
        _write(root / "bin" / "pdsh", PDSH, 0o755)
        argv = ["--hostfile", "hostfile", "--master_addr", nodes[0][0], "--no_ssh_check", "--launcher", "pdsh",
                *(["--venv_script", str(activate)] if venv_script else []), *(["--force_multi"] if force_multi else []),
                "train.py", "--deepspeed_config", "ds_config.json"]
        environ = {"PATH": f"{root / 'bin'}:{NODE_PATH}", "HOME": str(home), **shell_vars}
        with _as_the_deepspeed_command(environ, job) as recorder:
            runner.main(argv)
        if len(recorder.calls) != 1:
            raise CannotTellError(f"the launcher started {len(recorder.calls)} commands, not one")
        command, environment = recorder.calls[0]
        hosts = [host for host, _ in nodes]
        if command[0] == "pdsh":
            lines = _node_lines(command, hosts)
            seen = [_node_environment(line, home) for line in lines]
            # main sets PYTHONPATH to the launch directory (before the shell's own, where it has one) and exports it
            pythonpath = ":".join([str(job), *([shell_vars["PYTHONPATH"]] if "PYTHONPATH" in shell_vars else [])])
            expected = {**shell_vars, "PYTHONPATH": pythonpath, **DEEPSPEED_ENV,
                        **({"VIRTUAL_ENV": str(venv)} if venv_script else {})}
        else:  # one node: the launcher starts deepspeed.launcher.launch itself, with its own environment
            lines = [" ".join(command)]
            seen = [environment]
            expected = shell_vars
        shown = lambda text: text.replace(str(root), TMP).replace(sys.executable, "python")  # noqa: E731
        return Launch(tuple(shown(word) for word in argv), tuple(shown(word) for word in command), tuple(hosts),
                      tuple(shown(line) for line in lines), {key: shown(value) for key, value in expected.items()},
                      tuple({key: None if env.get(key) is None else shown(env[key]) for key in expected}
                            for env in seen))


def _node_lines(command: list[str], hosts: list[str]) -> list[str]:
    """pdsh's command (``pdsh -S -f N -w host,host <words>``): for each host, the line its shell runs."""
    at = command.index("-w")
    if command[at + 1].split(",") != hosts:
        raise CannotTellError(f"pdsh runs on {command[at + 1]}, not on {','.join(hosts)}")
    line = " ".join(command[at + 2:])
    return [line.replace("%n", str(rank)) for rank in range(len(hosts))]


def _node_environment(line: str, home: Path) -> dict[str, str]:
    """Run ``line`` as a node's shell would, in ``bash -c`` from the node's home with only its login variables, up to
    where it starts DeepSpeed's per-node launcher; in its place a Python prints the environment it starts with."""
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


__all__ = ["DEEPSPEED_ENV", "Launch", "ONE_NODE", "SHELL", "TWO_NODES", "has_venv_script", "launch"]
