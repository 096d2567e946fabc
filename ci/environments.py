"""The Fixbook's other (Python, torch) environments, as data (``ci/environments.toml``).

    python -m ci.environments install              # build every environment (idempotent)
    python -m ci.environments list

Each environment is a venv in ``.envs/<name>`` with its torch and DeepSpeed's pure-Python
requirements. The DeepSpeed releases of ``.deepspeed/`` are pure Python (installed with
``DS_BUILD_OPS=0``), so every environment uses the same directories: :func:`run_python` puts the
release and this checkout on ``PYTHONPATH``.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import releases

from . import ROOT
FILE = ROOT / "ci" / "environments.toml"
ENVS = ROOT / ".envs"
RUNTIME_REQUIREMENTS = ROOT / "ci" / "requirements-runtime.txt"


class EnvironmentError_(RuntimeError):
    """An environment that cannot be built or found here (the message names it)."""


@dataclass(frozen=True)
class Environment:
    name: str
    python: str  # "3.12"
    torch: str

    @property
    def venv(self) -> Path:
        return ENVS / self.name

    @property
    def executable(self) -> Path:
        return self.venv / "bin" / "python"

    def is_installed(self) -> bool:
        """Built to completion for this torch (the marker is written last)."""
        marker = self.venv / ".fixbook-ready"
        return marker.exists() and marker.read_text().strip() == self.torch


def load() -> dict[str, Environment]:
    data = tomllib.loads(FILE.read_text())
    return {name: Environment(name, str(spec["python"]), str(spec["torch"])) for name, spec in data.items()}


def get(name: str) -> Environment:
    known = load()
    if name not in known:
        raise EnvironmentError_(f"unknown environment {name!r}; known: {', '.join(known)}")
    return known[name]


def interpreter(version: str) -> str | None:
    """A CPython ``version`` here: pyenv's (``$PYENV_ROOT`` or ``~/.pyenv``), then ``pythonX.Y`` on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob(f"{version}.*/bin/python3"), reverse=True):
        if candidate.is_file():
            return str(candidate)
    return shutil.which(f"python{version}")


def install(env: Environment) -> float:
    """Build ``env`` if it is not ready; returns the seconds it took (0 if it was ready)."""
    if env.is_installed():
        return 0.0
    python = interpreter(env.python)
    if python is None:
        raise EnvironmentError_(f"environment {env.name}: CPython {env.python} is not on this machine "
                                f"(looked in pyenv and for python{env.python} on PATH)")
    started = time.monotonic()
    if not env.executable.exists():
        subprocess.run([python, "-m", "venv", str(env.venv)], check=True)
    pip = [str(env.executable), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, f"torch=={env.torch}"], check=True)
    subprocess.run([*pip, "-r", str(RUNTIME_REQUIREMENTS)], check=True)
    (env.venv / ".fixbook-ready").write_text(env.torch)
    return time.monotonic() - started


def run_python(env: Environment, release: str, args: list[str], timeout: float = 600,
               **kwargs) -> subprocess.CompletedProcess:
    """Run ``env``'s Python with DeepSpeed ``release`` and this checkout's ``fixes`` importable."""
    if not env.is_installed():
        raise EnvironmentError_(f"environment {env.name} is not built: python -m ci.environments install")
    if not releases.is_installed(release):
        raise EnvironmentError_(f"DeepSpeed {release} is not installed in {releases.INSTALL_ROOT}")
    selected = releases.environment(release)
    selected["PYTHONPATH"] = os.pathsep.join([selected["PYTHONPATH"], str(ROOT)])
    env_vars = {**os.environ, **selected, "DS_ACCELERATOR": "cpu", "FIXBOOK_ENVIRONMENT": env.name}
    return subprocess.run([str(env.executable), *args], env=env_vars, timeout=timeout, cwd=ROOT, **kwargs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.environments", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["install", "list"])
    args = parser.parse_args(argv)
    for env in load().values():
        if args.command == "install":
            try:
                seconds = install(env)
            except (EnvironmentError_, subprocess.CalledProcessError) as exc:
                print(f"environment {env.name} could not be built: {exc}", file=sys.stderr)
                return 1
            done = f"built in {seconds:.0f} s" if seconds else "ready"
            print(f"environment {env.name} (Python {env.python}, torch {env.torch}): {done}, {env.venv.relative_to(ROOT)}")
        else:
            print(f"{env.name}\tPython {env.python}\ttorch {env.torch}\t{'ready' if env.is_installed() else 'missing'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
