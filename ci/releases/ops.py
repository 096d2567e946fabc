"""DeepSpeed's JIT ops that the notebooks' runs build on first use, built while the releases install.

A notebook that makes DeepSpeed compile an op on a release says so in its metadata::

    "metadata": {"fixbook": {"jit_ops": {"0.16.0": ["FusedAdamBuilder"]}}}

that is: run on DeepSpeed 0.16.0, it loads ``FusedAdamBuilder``'s op (DeepSpeed's ``FusedAdam`` builds it on CPU the
first time, about 85 s of CPU). :func:`ci.releases.install_all` installs such releases first and builds each declared
op as soon as its release is installed, beside the other releases' installs, with the very call the run makes
(``get_accelerator().create_op_builder(NAME).load()``) in the release's environment (:func:`ci.releases.environment`:
its extensions directory, the compiler without ``-g``, the compiler cache). A run then finds the op built and loads it.
Only the project venv's builds (the main job's environment) are made ahead; another environment's run builds its own.

A build that fails is reported on stderr and left to the run, which builds it again and fails in its notebook, where
the failure is shown; set-up goes on.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from .. import ROOT

NOTEBOOKS = ROOT / "notebooks"
# The child's program: load each named op builder's op through the accelerator, as DeepSpeed's optimizers do.
LOAD = ("import sys\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "for name in sys.argv[1:]:\n"
        "    get_accelerator().create_op_builder(name).load(verbose=False)\n")
BUILD_TIMEOUT_S = 900.0


class OpsDeclarationError(ValueError):
    """A notebook's ``jit_ops`` metadata is not a mapping of release to a list of op builder class names."""


def declared(notebooks: Path = NOTEBOOKS) -> dict[str, list[str]]:
    """Every notebook's declared ops, merged: release -> op builder class names (sorted, each once)."""
    merged: dict[str, set[str]] = {}
    for path in sorted(notebooks.glob("*.ipynb")):
        metadata = json.loads(path.read_text()).get("metadata", {})
        ops = metadata.get("fixbook", {}).get("jit_ops", {})
        if not isinstance(ops, dict) or not all(
                isinstance(names, list) and all(isinstance(name, str) and name for name in names)
                for names in ops.values()):
            raise OpsDeclarationError(f"{path.name}: metadata fixbook.jit_ops must map a release to a list of op "
                                      f"builder class names (e.g. {{\"0.16.0\": [\"FusedAdamBuilder\"]}}), not {ops!r}")
        for release, names in ops.items():
            merged.setdefault(release, set()).update(names)
    return {release: sorted(names) for release, names in merged.items()}


def build(release: str, names: list[str], run: Callable[..., subprocess.CompletedProcess],
          timeout: float = BUILD_TIMEOUT_S) -> bool:
    """Build ``names``' ops for ``release`` (installed) in its environment, as a run would on first use: ``run`` is
    :func:`ci.releases.run_python_any` (which runs Python with a release selected). True where they built (or were
    built already); otherwise a line on stderr says why, and False."""
    try:
        done = run(release, ["-c", LOAD, *names], timeout=timeout, capture_output=True, text=True,
                   extra_env={"DS_ACCELERATOR": "cpu"})
    except subprocess.TimeoutExpired:
        print(f"DeepSpeed {release}: building {', '.join(names)} ahead took over {timeout:.0f} s; the notebooks' "
              f"runs build them", file=sys.stderr, flush=True)
        return False
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-3:]
        print(f"DeepSpeed {release}: building {', '.join(names)} ahead failed ({' | '.join(last)}); the notebooks' "
              f"runs build them", file=sys.stderr, flush=True)
        return False
    return True


class Builder:
    """Builds declared ops in background threads, each once its release is installed (:meth:`installed`);
    :meth:`wait` joins them and returns the releases whose builds failed."""

    def __init__(self, ops: dict[str, list[str]], run: Callable[..., subprocess.CompletedProcess]) -> None:
        self._ops, self._run = ops, run
        self._threads: list[threading.Thread] = []
        self._failed: list[str] = []

    def first(self, releases: list[str]) -> list[str]:
        """``releases`` with those that have ops to build first (in their order), so their builds start early."""
        return sorted(releases, key=lambda release: release not in self._ops)

    def installed(self, release: str) -> None:
        if release not in self._ops:
            return

        def run() -> None:
            if not build(release, self._ops[release], self._run):
                self._failed.append(release)

        thread = threading.Thread(target=run, name=f"ops-{release}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def wait(self) -> list[str]:
        for thread in self._threads:
            thread.join()
        return sorted(self._failed)
