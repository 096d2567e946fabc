"""The Fixbook's other (Python, torch) environments, as data (``ci/environments.toml``).

    python -m ci.releases.environments install [NAME ...]  # build them (idempotent) and write their kernels
    python -m ci.releases.environments list                # each one's state, set-up time and disk size

Each environment is a venv in ``.envs/<name>`` with its torch (and the extra pins the file gives it),
DeepSpeed's pure-Python requirements and ipykernel. The DeepSpeed releases of ``.deepspeed/`` are
pure Python (installed with ``DS_BUILD_OPS=0``), so every environment uses the same directories:
:func:`run_python` and the kernels (:func:`write_kernel`, ``deepspeed-<release>-<name>``) put the
release and this checkout on ``PYTHONPATH``. The project venv itself is the environment
:data:`DEFAULT` (``cpu``); it is not in the file.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from .. import releases
from . import UV_CACHE, installer  # noqa: F401 - the environments' installer too

from .. import ROOT
FILE = ROOT / "ci" / "environments.toml"
ENVS = ROOT / ".envs"
RUNTIME_REQUIREMENTS = ROOT / "ci" / "requirements-runtime.txt"
PROJECT_REQUIREMENTS = ROOT / "ci" / "requirements.txt"  # ipykernel's pin is read from here
DEFAULT = "cpu"  # the project venv's environment (the name rows and run records carry by default)
_KEYS = {"python", "torch", "requirements", "notebooks", "tests"}


class EnvironmentError_(RuntimeError):
    """An environment that cannot be built or found here (the message names it)."""


def _requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


def _name(requirement: str) -> str:
    return canonicalize_name(Requirement(requirement).name)


def kernel_requirement() -> str:
    """The project venv's ipykernel pin (``ci/requirements.txt``), so every kernel speaks the same protocol."""
    found = [line for line in _requirement_lines(PROJECT_REQUIREMENTS) if _name(line) == "ipykernel"]
    if not found:
        raise EnvironmentError_(f"{PROJECT_REQUIREMENTS} pins no ipykernel")
    return found[0]


@dataclass(frozen=True)
class Environment:
    name: str
    python: str  # "3.12"
    torch: str
    requirements: tuple[str, ...] = ()  # extra pins, e.g. ("numpy<2",)
    notebooks: tuple[str, ...] = ()  # entries whose notebook also runs here, on its reproduce release
    tests: bool = False  # the test command uses it: `bash ci/setup.sh` builds it (the others: `ci/setup.sh matrix`)

    @property
    def venv(self) -> Path:
        return ENVS / self.name

    @property
    def executable(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def marker(self) -> Path:
        return self.venv / ".fixbook-ready"

    def install_requirements(self) -> list[str]:
        """What pip installs, in one resolver run: torch, the extra pins, the runtime requirements (a
        pin replaces the runtime line for the same package) and ipykernel."""
        pinned = {_name(pin) for pin in self.requirements}
        runtime = [line for line in _requirement_lines(RUNTIME_REQUIREMENTS) if _name(line) not in pinned]
        return [f"torch=={self.torch}", *self.requirements, *runtime, kernel_requirement()]

    def is_installed(self) -> bool:
        """Built to completion with today's requirements (the marker, written last, lists them)."""
        return self.marker.exists() and self.marker.read_text().splitlines() == self.install_requirements()

    def build_info(self) -> dict[str, dict[str, object]]:
        """How long building it from nothing took (``built``) and the last update, if any (``updated``):
        ``python -m ci.releases.environments install`` records both, as {"seconds": ..., "at": ...}."""
        path = self.venv / ".fixbook-build.json"
        return json.loads(path.read_text()) if path.exists() else {}


def load() -> dict[str, Environment]:
    data = tomllib.loads(FILE.read_text())
    known = {}
    for name, spec in data.items():
        unknown = set(spec) - _KEYS
        if unknown or not {"python", "torch"} <= set(spec):
            raise EnvironmentError_(f"{FILE}: environment {name} needs python and torch and may have "
                                    f"requirements, notebooks and tests; unknown keys: {', '.join(sorted(unknown)) or 'none'}")
        extra = tuple(str(pin) for pin in spec.get("requirements", ()))
        for pin in extra:
            Requirement(pin)  # a malformed pin fails here, naming itself
        if not isinstance(spec.get("tests", False), bool):
            raise EnvironmentError_(f"{FILE}: environment {name}: tests is true or false")
        known[name] = Environment(name, str(spec["python"]), str(spec["torch"]), extra,
                                  tuple(str(entry) for entry in spec.get("notebooks", ())), spec.get("tests", False))
    return known


def get(name: str) -> Environment:
    known = load()
    if name not in known:
        raise EnvironmentError_(f"unknown environment {name!r}; known: {', '.join(known)}")
    return known[name]


def require(name: str) -> Environment:
    """``name``, built: an environment that is not fails naming it (a test must not skip it)."""
    env = get(name)
    if not env.is_installed():
        raise EnvironmentError_(f"environment {env.name} (Python {env.python}, torch {env.torch}) is not built "
                                f"in {env.venv}: run `python -m ci.releases.environments install {env.name}` "
                                "(or bash ci/setup.sh)")
    return env


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
    fresh = not env.executable.exists()
    uv = installer()
    if fresh:
        subprocess.run([uv, "venv", "--quiet", "--seed", "-p", python, str(env.venv)] if uv else
                       [python, "-m", "venv", str(env.venv)], check=True)
    env.marker.unlink(missing_ok=True)
    if uv:
        # uv downloads in parallel (pip took 5m34s for colab-shape, uv 1m24s, the same machine and load) and
        # byte-compiles on all cores, as pip does on one: without it every process of the environment compiles the
        # torch modules it imports again where PYTHONDONTWRITEBYTECODE is set. Its cache is hard-linked into the
        # venv, so it costs no second copy on disk.
        command = [uv, "pip", "install", "--quiet", "--compile-bytecode", "-p", str(env.executable),
                   *env.install_requirements()]
    else:
        # --no-cache-dir: PyPI's CUDA torch and its nvidia-* wheels are GBs that pip would also keep in its cache,
        # doubling what a build needs on disk, for a venv that is built once per machine.
        command = [str(env.executable), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                   "--no-cache-dir", *env.install_requirements()]
    try:
        subprocess.run(command, check=True, env={**os.environ, "UV_CACHE_DIR": str(UV_CACHE)})
    except subprocess.CalledProcessError as exc:
        raise EnvironmentError_(f"environment {env.name}: {'uv' if uv else 'pip'} exited {exc.returncode} "
                                f"({free_disk()} on the disk of {ENVS})") from exc
    seconds = time.monotonic() - started
    info = {} if fresh else env.build_info()
    info["built" if fresh else "updated"] = {"seconds": round(seconds, 1),
                                             "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (env.venv / ".fixbook-build.json").write_text(json.dumps(info, indent=1))
    env.marker.write_text("\n".join(env.install_requirements()) + "\n")
    return seconds


def free_disk(path: Path = ROOT) -> str:
    """The free space on ``path``'s disk, in GiB, for messages (a build that fails for room says so)."""
    while not path.exists():
        path = path.parent
    return f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free"


def disk_size(env: Environment) -> int:
    """Bytes under the venv (files only, links not followed: what ``du`` counts, near enough)."""
    total = 0
    for directory, _, files in os.walk(env.venv):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                total += os.stat(path).st_blocks * 512
    return total


def variables(env: Environment, release: str) -> dict[str, str]:
    """The variables that select DeepSpeed ``release`` and this checkout's ``fixes`` for ``env``'s Python."""
    selected = releases.environment(release)
    selected["PYTHONPATH"] = os.pathsep.join([selected["PYTHONPATH"], str(ROOT)])
    # Its own torch-extension builds (DeepSpeed's JIT ops, e.g. fused_adam): another Python or torch builds another
    # binary, and sharing the project venv's directory made each side rebuild the other's, under one lock.
    if env.name != DEFAULT:
        selected["TORCH_EXTENSIONS_DIR"] = str(releases.extensions_dir(release, env.name))
    return {**selected, "DS_ACCELERATOR": "cpu", "FIXBOOK_ENVIRONMENT": env.name}


def run_python(env: Environment, release: str, args: list[str], timeout: float = 600,
               **kwargs) -> subprocess.CompletedProcess:
    """Run ``env``'s Python with DeepSpeed ``release`` and this checkout's ``fixes`` importable."""
    require(env.name)
    if not releases.is_installed(release):
        raise EnvironmentError_(f"DeepSpeed {release} is not installed in {releases.INSTALL_ROOT}")
    env_vars = {**os.environ, **variables(env, release)}
    return subprocess.run([str(env.executable), *args], env=env_vars, timeout=timeout, cwd=ROOT, **kwargs)


def kernel_name(env: Environment | str, release: str) -> str:
    """``deepspeed-<release>-<env>``; the default environment's kernels are :func:`ci.releases.kernel_name`'s."""
    name = env if isinstance(env, str) else env.name
    return releases.kernel_name(release) if name == DEFAULT else f"{releases.kernel_name(release)}-{name}"


def kernels_dir() -> Path:
    """Where the project's Jupyter looks for kernels: the running venv's (as :func:`ci.releases.write_kernel`)."""
    return Path(sys.prefix) / "share" / "jupyter" / "kernels"


def write_kernel(env: Environment, release: str) -> str:
    """A Jupyter kernel ``deepspeed-<release>-<env>`` running ``env``'s Python with ``release`` selected;
    returns its name. Fails naming the environment or release if either is not installed."""
    require(env.name)
    if not releases.is_installed(release):
        raise EnvironmentError_(f"DeepSpeed {release} is not installed in {releases.INSTALL_ROOT}: "
                                "python -m ci.releases install")
    name = kernel_name(env, release)
    kernel_dir = kernels_dir() / name
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [str(env.executable), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"DeepSpeed {release}, {env.name}: Python {env.python}, torch {env.torch} (Fixbook)",
        "language": "python",
        "env": variables(env, release),
        "metadata": {"debugger": False, "fixbook_environment": env.name},
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return name


def kernel(env_name: str, release: str) -> str:
    """The kernel name for (``env_name``, ``release``), written if needed: what a runner passes to papermill.
    ``cpu`` is the project venv's kernel (:func:`ci.releases.kernel_name`)."""
    if env_name == DEFAULT:
        return releases.kernel_name(release)
    return write_kernel(require(env_name), release)


def notebook_runs() -> list[tuple[str, str]]:
    """(entry, environment) for every notebook an environment of the file also runs (its ``notebooks``),
    on the entry's reproduce release: what the runner adds to the default matrix."""
    import fixes

    every = fixes.available()
    return [(entry, env.name) for env in load().values()
            for entry in (every if tuple(env.notebooks) == ("*",) else env.notebooks)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.releases.environments", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["install", "list"])
    parser.add_argument("names", nargs="*", help="environments (default: every one in the file)")
    parser.add_argument("--tests", action="store_true",
                        help="only the environments the test command uses (tests = true in the file)")
    args = parser.parse_args(argv)
    try:
        chosen = [get(name) for name in args.names] if args.names else list(load().values())
        chosen = [env for env in chosen if env.tests or not args.tests]
    except EnvironmentError_ as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = []
    built: dict[str, "Future[float]"] = {}
    if args.command == "install":  # every environment at once: mostly downloads, each pip on its own core
        from concurrent.futures import Future, ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=max(1, len(chosen)))
        existed = {env.name: env.executable.exists() for env in chosen}  # an existing venv is updated, not built
        built = {env.name: pool.submit(install, env) for env in chosen}
        pool.shutdown(wait=True)
    for env in chosen:
        if args.command == "install":
            try:
                seconds = built[env.name].result()
                kernels = [write_kernel(env, r) for r in releases.load().releases if releases.is_installed(r)]
                # the DeepSpeed releases, byte-compiled for this Python too (another Python reads other .pyc files)
                releases.compile_bytecode(env.executable, [*(releases.install_dir(r) for r in releases.installed_releases()),
                                                           ROOT / "fixes"])
            except (EnvironmentError_, subprocess.CalledProcessError) as exc:
                print(f"environment {env.name} could not be built: {exc}", file=sys.stderr)
                failed.append(env.name)
                continue
            how = "updated" if existed[env.name] else "built"
            done = f"{how} in {seconds:.0f} s" if seconds else "ready"
            print(f"environment {env.name} (Python {env.python}, torch {env.torch}): {done}, "
                  f"{env.venv.relative_to(ROOT)} ({disk_size(env) / 2**30:.1f} GiB; {free_disk()} after); "
                  f"kernels {kernel_name(env, '<release>')} for "
                  f"{len(kernels)} release(s)", flush=True)
        else:
            state = "ready" if env.is_installed() else "missing"
            info = env.build_info()
            extra = "".join(f"\t{how} in {info[how]['seconds']:.0f} s ({info[how]['at']})"
                            for how in ("built", "updated") if how in info) + (
                f"\t{disk_size(env) / 2**30:.1f} GiB" if env.venv.exists() else "")
            print(f"{env.name}\tPython {env.python}\ttorch {env.torch}"
                  f"{''.join(' ' + pin for pin in env.requirements)}\t{state}{extra}")
    if failed:
        print(f"not built: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
