"""The DeepSpeed release environments: which releases (``ci/releases.toml``), where each lives,
its Jupyter kernel, and how to run Python under it.

    python -m ci.releases install     # install missing releases (the set + sweep boundaries), write kernels
    python -m ci.releases install --no-boundaries   # the set only (what the notebooks run on)
    python -m ci.releases list
    python -m ci.sweep.new_release update ...  # a new DeepSpeed release on PyPI: ci/sweep/new_release.py

Package ``ci.releases``: the release set, its installs and kernels (here), the other environments
(``environments.py``: ``python -m ci.releases.environments``) and the set-up plan that ``ci/setup.sh`` prints before
the venv exists (``setup_plan.py``, run as ``python3 ci/releases/setup_plan.py``: standard library only).
May import: ``ci.processes`` and ``fixes``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import ROOT
from ..processes import zygote
from . import wheels
RELEASES_FILE = ROOT / "ci" / "releases.toml"
INSTALL_ROOT = ROOT / ".deepspeed"
EXTENSIONS = ".torch_extensions"  # in a release's directory: its JIT ops, one directory per environment
COMPILER_CACHE = ROOT / ".cache" / "ccache"
CCACHE_CXX = Path("/usr/lib/ccache/c++")  # Debian's ccache package: the compiler, through its cache
CXX_WRAPPER = ROOT / "ci" / "releases" / "cxx"  # the compiler of the JIT op builds: FIXBOOK_CXX without -g


@dataclass(frozen=True)
class ReleaseSet:
    torch: str
    newest: str
    releases: tuple[str, ...]


def load() -> ReleaseSet:
    data = tomllib.loads(RELEASES_FILE.read_text())
    releases = tuple(data["releases"])
    if data["newest"] not in releases:
        raise ValueError(f"{RELEASES_FILE}: newest {data['newest']} is not in releases")
    return ReleaseSet(torch=data["torch"], newest=data["newest"], releases=releases)


@dataclass(frozen=True)
class OlderReleases:
    """Releases older than the sweep's oldest (``[[older]]`` in ``ci/releases.toml``): why the project venv cannot
    run them, and either the environment that does (``environment``) or why none here can (``cannot``), with the
    commands tried and what each answered."""

    span: str
    why: str
    environment: str = ""
    cannot: str = ""
    tried: tuple[str, ...] = ()
    answer: tuple[str, ...] = ()


def older() -> list[OlderReleases]:
    """The ``[[older]]`` tables of ``ci/releases.toml``, in order; each states an environment or why none runs it."""
    found = []
    for table in tomllib.loads(RELEASES_FILE.read_text()).get("older", []):
        item = OlderReleases(table["span"], table["why"], table.get("environment", ""), table.get("cannot", ""),
                             tuple(table.get("tried", ())), tuple(table.get("answer", ())))
        if bool(item.environment) == bool(item.cannot) or len(item.tried) != len(item.answer):
            raise ValueError(f"{RELEASES_FILE}: [[older]] {item.span} needs either environment or cannot (with one "
                             "answer per command tried)")
        found.append(item)
    return found


def sample_releases() -> tuple[str, ...]:
    """The sweep's boundary releases (first/last affected, first fixed of every entry) outside the
    release set: the default test run re-checks them, so setup installs them too (no kernels)."""
    from fixes import measured

    release_set = set(load().releases)
    found = {release for sweep in measured.load().results.values() for release in sweep.boundaries}
    return tuple(sorted(found - release_set, key=lambda r: tuple(int(p) for p in r.split("."))))


def check_known(release: str) -> str:
    if release in load().releases:  # the release set: no need to derive the sweep's boundaries
        return release
    known = (*load().releases, *sample_releases())
    if release not in known:
        raise ValueError(f"DeepSpeed {release} is neither in ci/releases.toml nor a sweep boundary release "
                         f"(known: {', '.join(known)})")
    return release


def install_dir(release: str) -> Path:
    return INSTALL_ROOT / release


def kernel_name(release: str) -> str:
    return f"deepspeed-{release}"


def is_installed(release: str) -> bool:
    return (install_dir(release) / f"deepspeed-{release}.dist-info").is_dir()


def extensions_dir(release: str, environment_name: str = "cpu") -> Path:
    """Where ``release``'s JIT ops (``fused_adam`` or ``cpu_adam``, built on first use by their optimizers; the
    releases installed here list ``deepspeed_shm_comm`` as incompatible, so ``init_distributed`` builds none) are
    built for one environment (another Python or torch builds another binary). Inside the release's own directory, so that every release's build sees its
    sources at the same relative path: the compiler cache (:func:`compiler_cache_variables`) then serves a release
    whose op sources are byte for byte another's without compiling them again."""
    return install_dir(release) / EXTENSIONS / environment_name


def compiler_cache_variables() -> dict[str, str]:
    """The variables of DeepSpeed's JIT op builds: the compiler is ``ci/releases/cxx`` (:data:`CXX_WRAPPER`), which
    leaves out ``-g`` (no generated instruction changes; 55.6 s of CPU against 95.7 s for 0.19.8's fused_adam) and
    runs Debian's ccache where it is installed (``ci/setup.sh`` installs it as root), else ``c++``. torch's own
    ccache prefix (newer torch adds one where ``ccache`` is on the PATH) is turned off: the wrapper's ccache sees the
    real compiler. Through ccache, paths under the checkout are hashed relative to the build directory
    (``CCACHE_BASEDIR``), so identical sources of two releases are one cache entry; ccache compares the sources
    and headers themselves, never only their names."""
    variables = {"CXX": str(CXX_WRAPPER), "TORCH_NO_COMPILER_WRAPPER": "1"}
    if CCACHE_CXX.exists():
        variables.update({"FIXBOOK_CXX": str(CCACHE_CXX), "CCACHE_DIR": str(COMPILER_CACHE),
                          "CCACHE_BASEDIR": str(ROOT), "CCACHE_NOHASHDIR": "1"})
    return variables


def environment(release: str) -> dict[str, str]:
    """Variables that select ``release`` for a Python process (a kernel, a test's child)."""
    return {
        "PYTHONPATH": str(install_dir(release)),
        "TORCH_EXTENSIONS_DIR": str(extensions_dir(release)),
        "FIXBOOK_DEEPSPEED_RELEASE": release,
        **compiler_cache_variables(),
    }


def installed_releases() -> list[str]:
    """Every release installed in ``.deepspeed/``, oldest first."""
    found = [d.name for d in INSTALL_ROOT.glob("*") if is_installed(d.name)] if INSTALL_ROOT.is_dir() else []
    return sorted(found, key=lambda r: tuple(int(p) for p in r.split(".")))


def run_python(release: str, args: list[str], timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """Run the venv's Python with ``release`` (of the release set or a sweep boundary) selected."""
    return run_python_any(check_known(release), args, timeout, **kwargs)


def run_python_any(release: str, args: list[str], timeout: float = 600, extra_env: dict[str, str] | None = None,
                   **kwargs) -> subprocess.CompletedProcess:
    """Run the venv's Python with any installed ``release`` selected."""
    env = {**os.environ, **environment(release), **(extra_env or {})}
    return subprocess.run([*zygote.command(env=env), *args], env=env, timeout=timeout, cwd=ROOT, **kwargs)


UV_CACHE = ROOT / ".cache" / "uv"  # on the venvs' disk: uv hard-links from it


def installer() -> str | None:
    """The project venv's uv (ci/requirements.txt pins it), or None: then pip installs the releases and builds the
    environments."""
    candidate = Path(sys.executable).parent / "uv"
    return str(candidate) if candidate.is_file() else shutil.which("uv")


def install_command(release: str, target: Path, uv: str | None, source: str | None = None) -> list[str]:
    """The command that installs ``release`` into ``target``: ``uv pip install`` where ``uv`` is given, else ``pip
    install``; both with ``--no-deps --target`` and ``--no-build-isolation``, so a build sees the venv's torch
    (DeepSpeed's setup.py imports it) and no other torch is ever downloaded. ``source`` is what is installed: a wheel
    already built (:mod:`ci.releases.wheels`), or by default ``deepspeed==RELEASE`` from PyPI, whose sdist the
    installer builds (uv in about half pip's time: 5.3 s against 9.8 s for 0.17.6, on 2 cores)."""
    options = ["--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), source or f"deepspeed=={release}"]
    if uv:
        return [uv, "pip", "install", "-p", sys.executable, *options]
    return [sys.executable, "-m", "pip", "install", *options]


def compile_bytecode(python: str | Path, directories: list[Path]) -> bool:
    """Byte-compile every module under ``directories`` for ``python`` (``compileall``, all cores; a module whose
    ``.pyc`` is up to date is skipped), as pip does for what it installs. uv installs compile nothing, and where
    ``PYTHONDONTWRITEBYTECODE`` is set no process writes a ``.pyc`` either: every process that imports DeepSpeed
    would then compile its modules again (a test run starts hundreds).

    A module that does not compile for ``python`` is left as it is (it is compiled, or fails, when imported, as
    without this step): the others are still compiled, a line on stderr names it, and the result is False."""
    existing = [str(directory) for directory in directories if directory.is_dir()]
    if not existing:
        return True
    done = subprocess.run([str(python), "-m", "compileall", "-q", "-j", "0", *existing], capture_output=True,
                          text=True)
    if done.returncode != 0:
        failed = [line for line in done.stdout.splitlines() if line.startswith("*** Error compiling")]
        print(f"byte-compiling for {python}: {len(failed) or 'some'} module(s) did not compile and compile when "
              f"imported instead: {'; '.join(failed[:3]) or done.stderr.strip()[-300:]}", file=sys.stderr, flush=True)
    return done.returncode == 0


def install(release: str) -> None:
    """Install ``release`` (:func:`install_command`) with ``DS_BUILD_OPS=0``, so no op is compiled. Where uv installs,
    the wheel is built from the sdist first in a child of the zygote (:mod:`ci.releases.wheels`, torch imported
    once for every release); where that fails, a line on stderr says why and the installer builds it, as before.
    Installed to a temporary directory first, so an interrupted install never leaves a half release behind. Its
    modules are byte-compiled by :func:`install_all`."""
    if is_installed(release):
        return
    INSTALL_ROOT.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{release}-", dir=INSTALL_ROOT))
    built = Path(tempfile.mkdtemp(prefix=f".{release}-wheel-", dir=INSTALL_ROOT))
    env = {**os.environ, "DS_BUILD_OPS": "0", "UV_CACHE_DIR": str(UV_CACHE)}
    try:
        uv = installer()
        source = None
        if uv:
            try:
                source = str(wheels.build_wheel(release, built, env))
            except wheels.WheelError as exc:
                print(f"DeepSpeed {release}: {exc}; the installer builds it instead", file=sys.stderr, flush=True)
        subprocess.run(install_command(release, staging, uv, source), env=env, check=True)
        (staging / ".lock").unlink(missing_ok=True)  # uv's lock file for the target, not part of the release
        # What an install from a wheel file records: that file's temporary path, gone once installed.
        (staging / f"deepspeed-{release}.dist-info" / "direct_url.json").unlink(missing_ok=True)
        shutil.rmtree(install_dir(release), ignore_errors=True)
        staging.rename(install_dir(release))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(built, ignore_errors=True)


def write_kernel(release: str) -> Path:
    """A Jupyter kernel in the venv (``<venv>/share/jupyter/kernels``) that runs ``release``."""
    kernel_dir = Path(sys.prefix) / "share" / "jupyter" / "kernels" / kernel_name(release)
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": f"DeepSpeed {release} (Fixbook)",
        "language": "python",
        "env": environment(release),
        "metadata": {"debugger": False},
    }
    (kernel_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return kernel_dir


def install_all(jobs: int = 2, boundaries: bool = True) -> None:
    """Install the release set (with kernels) and, with ``boundaries``, the sweep's boundary releases the
    tests re-check (the notebooks need only the set)."""
    releases = load().releases
    missing = [r for r in (*releases, *(sample_releases() if boundaries else ())) if not is_installed(r)]
    if missing:
        print(f"installing DeepSpeed {', '.join(missing)} into {INSTALL_ROOT}", flush=True)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            list(pool.map(install, missing))
    compile_bytecode(sys.executable, [install_dir(r) for r in (*releases, *(sample_releases() if boundaries else ()))])
    for release in releases:
        write_kernel(release)
    print(f"DeepSpeed releases ready: {', '.join(releases)} (kernels: "
          f"{', '.join(kernel_name(r) for r in releases)}); sweep boundary releases: "
          f"{', '.join(sample_releases()) or 'none'}")



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.releases", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["install", "list"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-boundaries", action="store_true",
                        help="install: only the release set (what the notebooks run on), not the sweep boundaries")
    args = parser.parse_args(argv)
    if args.command == "install":
        install_all(args.jobs, boundaries=not args.no_boundaries)
    else:
        for release in load().releases:
            print(f"{release}\t{'installed' if is_installed(release) else 'missing'}\t{kernel_name(release)}")
        for release in sample_releases():
            print(f"{release}\t{'installed' if is_installed(release) else 'missing'}\t(sweep boundary, no kernel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
