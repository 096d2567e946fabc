"""Notebook runs on a CUDA machine: the notebooks' CUDA path, kept in the run history as ``device: cuda``.

CI has no GPU. On a CUDA machine (one GPU, its own Python and CUDA torch, no network needed) three steps put what
the notebooks did there into ``fixes/data/runs.json``, the one source of every entry card's GPU status
(:func:`fixes.record.gpu_status`):

    python -m ci.tools.device bundle             # here: .device/ = wheels for that machine's Python, and the releases
    python3 -m ci.tools.device run --out "$OUT"  # there, carrying .device: every notebook of the matrix, on CUDA
    python -m ci.tools.device record DIR         # here: the runs DIR holds, into fixes/data/runs.json

On a machine with two or more GPUs, ``--ranks-on-gpus`` runs the two-rank checks instead: the notebooks whose CUDA
runs so far had their ranks on CPU (a one-GPU machine; ``ranks: "cpu"`` in the run history), now one GPU per rank
(NCCL), so that their records say what the bug does on CUDA:

    python -m ci.tools.device bundle --ranks-on-gpus
    python3 -m ci.device run --out "$OUT" --ranks-on-gpus    # refuses with fewer than two GPUs
    python -m ci.tools.device record DIR                          # replaces the ranks-on-CPU runs of those notebooks

``run`` installs the wheels into a directory of its own, unpacks the releases into ``.deepspeed/`` and writes one
Jupyter kernel per release around that machine's own Python and torch: the environment ``gpu``, whose records
name the GPU, the Python and the torch they ran on. The notebooks then run through the runner as in CI
(:func:`ci.notebooks.runner.run_matrix`), each release's notebooks on its reproduce release and on the newest. A launch of
more ranks than GPUs runs its ranks on CPU (``fixes.harness.env.rank_placement``); the notebook's own process,
its engines and its references run on the GPU. ``run`` refuses to start where no GPU is visible.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .. import ROOT

BUNDLE = ROOT / ".device"  # ignored: what travels to the GPU machine (``carry``)
ENVIRONMENT = "gpu"  # the environment name of every run made there
PYTHON = "3.12"  # the GPU machine's CPython (its image's /opt/torch/.venv)
# What the GPU machine's image lacks for the runner and the kernels; pinned to the project venv's versions.
RUNNER_PACKAGES = ("papermill", "nbclient", "nbformat", "jupyter_client", "ipykernel")
# Already on that machine with the torch it was built against: never carried.
NOT_CARRIED = ("numpy", "torch")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "linux_x86_64")
RESULTS = "device-runs.jsonl"  # a line {"machine": ...}, then a line {"result": ...} per run as it ends
EXECUTED = "executed.tar.gz"


class DeviceError(RuntimeError):
    """A device run cannot start (no GPU, no bundle); the message says what is missing."""


# ---- here: the bundle ----------------------------------------------------------------------------------------

def requirements() -> list[str]:
    """The pins the bundle's wheels are resolved from: the runner's packages at the project venv's versions,
    and DeepSpeed's runtime requirements (``ci/requirements-runtime.txt``) less :data:`NOT_CARRIED`."""
    from importlib.metadata import version

    from ..releases.environments import _name, _requirement_lines

    runtime = [line for line in _requirement_lines(ROOT / "ci" / "requirements-runtime.txt")
               if _name(line) not in NOT_CARRIED]
    return [f"{name}=={version(name)}" for name in RUNNER_PACKAGES] + runtime


def parse_only(only: list[str] | None) -> list[tuple[str, str]] | None:
    """``ENTRY@RELEASE`` selectors as (entry, release) pairs; ``None`` for none (the whole matrix)."""
    if not only:
        return None
    pairs = []
    for item in only:
        entry, at, release = item.partition("@")
        if not at or not entry or not release:
            raise DeviceError(f"--only takes ENTRY@RELEASE (e.g. zero3-linear-setup-context@0.18.9), not {item!r}")
        pairs.append((entry, release))
    return pairs


def matrix(entries: list[str] | None = None, only: list[tuple[str, str]] | None = None) -> list[tuple[str, str, str]]:
    """(entry, release, ``gpu``) for each notebook on the releases CI runs it on in the project venv; with
    ``only``, just those (entry, release) pairs of it (a pair the matrix does not run is an error)."""
    from ..notebooks import runner

    if only:
        entries = sorted({entry for entry, _ in only})
    pairs = [(entry, release, ENVIRONMENT) for entry, release, _ in runner.matrix(entries, environments=["cpu"])]
    if only:
        outside = sorted(set(only) - {(entry, release) for entry, release, _ in pairs})
        if outside:
            raise DeviceError("not in the notebook matrix: " + ", ".join(f"{e}@{r}" for e, r in outside))
        pairs = [p for p in pairs if (p[0], p[1]) in set(only)]
    return pairs


RANK_GPUS = 2  # the two-rank checks: one GPU per rank


def two_rank_checks(runs: list | None = None) -> list[tuple[str, str]]:
    """The (entry, release) runs of the matrix whose CUDA runs had their launched ranks on CPU (fewer GPUs than
    ranks), from the run history: what ``--ranks-on-gpus`` runs again on a machine with :data:`RANK_GPUS` GPUs."""
    from fixes.record import history

    runs = history() if runs is None else runs
    on_cpu = {(r.entry, r.release) for r in runs if r.device == "cuda" and r.ranks == "cpu"}
    return [(entry, release) for entry, release, _ in matrix() if (entry, release) in on_cpu]


def _source_only(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """A release's files as installed: no byte code, and none of the ops this machine built (``.torch_extensions``:
    built for its own environments; the GPU machine builds its own)."""
    from ..releases import EXTENSIONS

    parts = info.name.split("/")
    return None if "__pycache__" in parts or EXTENSIONS in parts else info


def bundle(entries: list[str] | None = None, python: str = PYTHON, out: Path = BUNDLE,
           only: list[tuple[str, str]] | None = None) -> Path:
    """Write ``out``: ``requirements.txt`` (:func:`requirements`), ``wheels/`` (every wheel they need, resolved
    for CPython ``python`` on x86-64 Linux) and ``releases/<release>.tar.gz`` (each release the matrix runs on,
    from ``.deepspeed/``, without byte code or built ops). Fails naming a release that is not installed."""
    from .. import releases

    needed = sorted({release for _, release, _ in matrix(entries, only)}, key=lambda r: tuple(map(int, r.split("."))))
    missing = [r for r in needed if not releases.is_installed(r)]
    if missing:
        raise DeviceError(f"not installed in {releases.INSTALL_ROOT}: {', '.join(missing)} (bash ci/setup.sh)")
    (out / "releases").mkdir(parents=True, exist_ok=True)
    for release in needed:
        with tarfile.open(out / "releases" / f"{release}.tar.gz", "w:gz") as tar:
            tar.add(releases.install_dir(release), arcname=release, filter=_source_only)
    pins = out / "requirements.txt"  # kept in the bundle: what its wheels were resolved from
    pins.write_text("\n".join(requirements()) + "\n")
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version",
                    python, "--implementation", "cp", *platforms, "-d", str(out / "wheels"), "-r", str(pins)],
                   check=True)
    (out / "entries.json").write_text(json.dumps(entries or []))
    (out / "only.json").write_text(json.dumps([f"{e}@{r}" for e, r in only or []]))
    return out


# ---- there: the run --------------------------------------------------------------------------------------------

def gpu_name(python: str = sys.executable) -> str:
    """The visible GPU's name, asked of a child process (this one must not touch CUDA before it forks its
    workers); raises :class:`DeviceError` where none is visible."""
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.get_device_name() "
                                          "if torch.cuda.is_available() else '')"],
                           capture_output=True, text=True, timeout=300)
    name = probe.stdout.strip()
    if probe.returncode != 0 or not name:
        raise DeviceError("no GPU is visible to this Python (torch.cuda.is_available() is False): a device run "
                          f"records CUDA runs only. {probe.stderr.strip()[-300:]}".strip())
    return name


def gpu_count(python: str = sys.executable) -> int:
    """How many GPUs this Python's torch sees, asked of a child process (0 where none, or no CUDA torch)."""
    probe = subprocess.run([python, "-c", "import torch; print(torch.cuda.device_count() "
                                          "if torch.cuda.is_available() else 0)"],
                           capture_output=True, text=True, timeout=300)
    return int(probe.stdout.strip() or 0) if probe.returncode == 0 else 0


def install_bundle(site: Path, bundle_dir: Path = BUNDLE) -> None:
    """The bundle's wheels into ``site`` (no index, no dependencies: the bundle is the whole set) and its
    releases into ``.deepspeed/``."""
    from .. import releases

    wheels = sorted((bundle_dir / "wheels").glob("*.whl"))
    if not wheels:
        raise DeviceError(f"no wheels in {bundle_dir / 'wheels'}: run `python -m ci.tools.device bundle` first")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *map(str, wheels)], check=True)
    for archive in sorted((bundle_dir / "releases").glob("*.tar.gz")):
        release = archive.name.removesuffix(".tar.gz")
        if not releases.is_installed(release):
            releases.INSTALL_ROOT.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archive) as tar:
                tar.extractall(releases.INSTALL_ROOT, filter="data")


def kernel_spec(release: str, site: Path) -> dict:
    """The Jupyter kernel running DeepSpeed ``release`` in this Python, with the bundle's packages and this
    checkout's ``fixes``; no ``DS_ACCELERATOR``: DeepSpeed picks CUDA as it does for a user."""
    from .. import releases

    selected = releases.environment(release)
    selected["PYTHONPATH"] = os.pathsep.join([selected["PYTHONPATH"], str(site), str(ROOT)])
    return {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"DeepSpeed {release}, {ENVIRONMENT} (Fixbook)", "language": "python",
            "env": {**selected, "FIXBOOK_ENVIRONMENT": ENVIRONMENT}, "metadata": {"debugger": False}}


def write_kernels(releases_: list[str], site: Path, kernels_root: Path) -> dict[tuple[str, str], str]:
    """One kernel per release under ``kernels_root/kernels`` (put on ``JUPYTER_PATH``); the runner's mapping."""
    names = {}
    for release in releases_:
        name = f"deepspeed-{release}-{ENVIRONMENT}"
        (kernels_root / "kernels" / name).mkdir(parents=True, exist_ok=True)
        (kernels_root / "kernels" / name / "kernel.json").write_text(json.dumps(kernel_spec(release, site), indent=1))
        names[(release, ENVIRONMENT)] = name
    return names


def run(out: Path, entries: list[str] | None = None, jobs: int = 4, cell_timeout: float = 240,
        bundle_dir: Path = BUNDLE, only: list[tuple[str, str]] | None = None, ranks_on_gpus: bool = False) -> int:
    """Every notebook of :func:`matrix` on this machine's GPU; ``out`` gets :data:`RESULTS` (the machine, then
    each run as it ends: a run that ended is kept even if the call is stopped later) and, at the end,
    :data:`EXECUTED` (the executed notebooks). Returns the number of failed runs. ``ranks_on_gpus``: the
    two-rank checks (:func:`two_rank_checks`) only, one at a time, refused with fewer than :data:`RANK_GPUS` GPUs."""
    import platform

    gpu = gpu_name()
    if ranks_on_gpus:
        count = gpu_count()
        if count < RANK_GPUS:
            raise DeviceError(f"{count} GPU(s) visible: the two-rank checks need {RANK_GPUS}, one per rank (on fewer "
                              "their ranks run on CPU, as the one-GPU runs already recorded did)")
        only, jobs = only or two_rank_checks(), 1  # one notebook at a time: its ranks hold the GPUs
    out.mkdir(parents=True, exist_ok=True)
    machine = {"gpu": gpu, "python": platform.python_version(), "at": dt.date.today().isoformat(),
               "gpus": gpu_count() if ranks_on_gpus else 1}
    work = Path(tempfile.mkdtemp(prefix="fixbook-device-"))
    site = work / "site"
    install_bundle(site, bundle_dir)
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))
    os.environ["JUPYTER_PATH"] = str(work / "jupyter")
    from ..notebooks import runner

    kept_only = bundle_dir / "only.json"
    only = only or parse_only(json.loads(kept_only.read_text()) if kept_only.exists() else None)
    pairs = matrix(entries or json.loads((bundle_dir / "entries.json").read_text()) or None, only)
    kernels = write_kernels(sorted({release for _, release, _ in pairs}), site, work / "jupyter")
    print(f"{len(pairs)} runs on {gpu}, {jobs} at a time", flush=True)
    with (out / RESULTS).open("w") as kept:
        def keep(line: dict) -> None:
            kept.write(json.dumps(line) + "\n")
            kept.flush()

        keep({"machine": machine})
        results = runner.run_matrix(pairs, cell_timeout, build=work / "build", jobs=jobs, kernels=kernels,
                                    on_result=lambda result: keep({"result": result.to_json()}))
    with tarfile.open(out / EXECUTED, "w:gz") as tar:
        tar.add(work / "build" / "executed", arcname="executed")
    failed = [r for r in results if not r.passed]
    for result in failed:
        print(f"FAILED: {result.entry} on {result.release}, cell {result.failed_cell}: {result.error}", flush=True)
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return len(failed)


# ---- here: the record ------------------------------------------------------------------------------------------

def record(directory: Path, history: Path | None = None) -> list:
    """Add the runs of ``directory``'s :data:`RESULTS` to the run history (each dated by its device run),
    replacing earlier runs of the same entry, release, environment and device; returns the summaries."""
    from fixes.record import HISTORY, RunResult, record_runs, summarize

    lines = [json.loads(line) for line in (directory / RESULTS).read_text().splitlines() if line.strip()]
    machine = lines[0]["machine"]
    summaries = [summarize(RunResult.from_json(line["result"]), machine["at"]) for line in lines[1:]]
    record_runs(summaries, history or HISTORY)
    return summaries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.tools.device", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    made = verbs.add_parser("bundle", help="write .device/ (wheels for the GPU machine's Python, the releases)")
    made.add_argument("--entry", action="append", help="entry id (repeatable; default: all)")
    made.add_argument("--python", default=PYTHON, help=f"the GPU machine's CPython (default {PYTHON})")
    made.add_argument("--only", action="append", metavar="ENTRY@RELEASE",
                      help="just this run of the matrix (repeatable; the run there takes the same ones)")
    made.add_argument("--ranks-on-gpus", action="store_true",
                      help="just the two-rank checks whose CUDA runs had their ranks on CPU (for a two-GPU machine)")
    ran = verbs.add_parser("run", help="on the GPU machine: every notebook of the matrix, on CUDA")
    ran.add_argument("--out", type=Path, required=True, help="where the results and executed notebooks go")
    ran.add_argument("--entry", action="append", help="entry id (repeatable; default: the bundle's)")
    ran.add_argument("--only", action="append", metavar="ENTRY@RELEASE", help="just this run (default: the bundle's)")
    ran.add_argument("--jobs", type=int, default=4)
    ran.add_argument("--cell-timeout", type=float, default=240)
    ran.add_argument("--ranks-on-gpus", action="store_true",
                     help=f"the two-rank checks, one GPU per rank (refused with fewer than {RANK_GPUS} GPUs)")
    kept = verbs.add_parser("record", help="merge a device run's results into fixes/data/runs.json")
    kept.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.verb == "bundle":
            only = parse_only(args.only) or (two_rank_checks() if args.ranks_on_gpus else None)
            print(f"bundle written: {bundle(args.entry, args.python, only=only)}")
            return 0
        if args.verb == "run":
            return 1 if run(args.out, args.entry, args.jobs, args.cell_timeout, only=parse_only(args.only),
                            ranks_on_gpus=args.ranks_on_gpus) else 0
        summaries = record(args.directory)
        cuda = [s for s in summaries if s.device == "cuda"]
        print(f"{len(summaries)} runs recorded, {len(cuda)} on CUDA")
        return 0
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
