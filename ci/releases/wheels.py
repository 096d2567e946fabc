"""A DeepSpeed release's wheel, built from its PyPI sdist in a child forked from the zygote (``ci.processes.zygote``),
which has imported torch already.

DeepSpeed publishes sdists only, and its ``setup.py`` imports torch and DeepSpeed itself (to list its ops). An
installer runs it in new Pythons: ``uv pip install deepspeed==0.18.4`` took 6.9 s of CPU; 0.19.8's ``setup.py`` build alone
6.4 s (cProfile: 2.4 s of it importing torch). Here the sdist's ``setup.py`` runs once, through setuptools' own PEP 517
backend for a project without ``pyproject.toml`` (``setuptools.build_meta:__legacy__``, what pip and uv run for it), in
a forked child that finds torch imported: about 1.9 s. The wheel is the same wheel; :func:`ci.releases.install`
installs it with ``--no-deps`` as before.

The sdist comes from PyPI's simple index (its JSON form, PEP 691), checked against the index's sha256.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import urllib.request
from pathlib import Path

from ..processes import zygote

INDEX = "https://pypi.org/simple/deepspeed/"
TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 600.0
# The child: setuptools' backend for a project without pyproject.toml, in the sdist's directory, as a PEP 517
# frontend calls it; it prints the wheel's file name last.
BUILD = "import sys\nfrom setuptools import build_meta\nprint(build_meta.__legacy__.build_wheel(sys.argv[1]))"

_files: dict[str, dict] = {}
_files_lock = threading.Lock()


class WheelError(Exception):
    """The wheel could not be made here (no sdist on the index, a download or a build that failed)."""


def sdist_file(release: str) -> dict:
    """The index's entry (``filename``, ``url``, ``hashes``) for ``deepspeed-RELEASE.tar.gz``; the index is read once
    per process."""
    with _files_lock:
        if not _files:
            request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
            try:
                with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                    _files.update({item["filename"]: item for item in json.load(response)["files"]})
            except (OSError, ValueError, KeyError) as exc:
                raise WheelError(f"{INDEX} could not be read: {exc}") from exc
    name = f"deepspeed-{release}.tar.gz"
    if name not in _files:
        raise WheelError(f"{INDEX} lists no {name}")
    return _files[name]


def download_sdist(release: str, into: Path) -> Path:
    """``release``'s sdist in ``into``, its sha256 checked against the index's."""
    entry = sdist_file(release)
    try:
        with urllib.request.urlopen(entry["url"], timeout=TIMEOUT_S) as response:
            blob = response.read()
    except OSError as exc:
        raise WheelError(f"{entry['url']} could not be downloaded: {exc}") from exc
    want = entry.get("hashes", {}).get("sha256")
    if not want or hashlib.sha256(blob).hexdigest() != want:
        raise WheelError(f"{entry['filename']}: its sha256 is not the index's ({want})")
    path = into / entry["filename"]
    path.write_bytes(blob)
    return path


def build_wheel(release: str, out: Path, env: dict[str, str] | None = None) -> Path:
    """Download ``release``'s sdist and build its wheel into ``out`` with ``env`` (default: this process's; the
    caller adds ``DS_BUILD_OPS=0``), in a child of the zygote where there is one (else a new Python, as an installer
    would). Raises :class:`WheelError` with the build's last lines where it fails."""
    env = dict(os.environ if env is None else env)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"deepspeed-{release}-sdist-"))
    try:
        with tarfile.open(download_sdist(release, scratch)) as archive:
            archive.extractall(scratch, filter="data")
        source = scratch / f"deepspeed-{release}"
        if not (source / "setup.py").is_file():
            raise WheelError(f"deepspeed-{release}.tar.gz has no deepspeed-{release}/setup.py")
        try:
            done = subprocess.run([*zygote.command(env=env), "-c", BUILD, str(out.resolve())], cwd=source, env=env,
                                  capture_output=True, text=True, errors="replace", timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            raise WheelError(f"building deepspeed {release}'s wheel took over {BUILD_TIMEOUT_S:.0f} s") from exc
        lines = done.stdout.strip().splitlines()
        wheel = out / lines[-1].strip() if done.returncode == 0 and lines else None
        if wheel is None or not wheel.is_file():
            tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-5:])
            raise WheelError(f"building deepspeed {release}'s wheel failed (exit {done.returncode}): {tail}")
        return wheel
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
