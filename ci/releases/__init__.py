"""The DeepSpeed release environments: which releases (``ci/releases.toml``), where each lives,
its Jupyter kernel, and how to run Python under it.

    python -m ci.releases install     # install missing releases (the set + sweep boundaries), write kernels
    python -m ci.releases install --no-boundaries   # the set only (what the notebooks run on)
    python -m ci.releases list
    python -m ci.releases update [--dry-run]   # a DeepSpeed release on PyPI newer than ci/releases.toml's newest:
                                               # add it, plan its sweep in shards, write the pull request's text
    python -m ci.releases update --check --outputs FILE   # only say which releases are new (stdlib and pip only)
    python -m ci.releases report --release R --build DIR --readme   # after the sweep and the notebooks: the text

``update`` asks the index with pip's own query (``pip index versions deepspeed``; ``--index-url URL`` asks that
index alone) and takes every final release newer than ``newest``; ``--release R`` takes R instead of asking.
It adds them to ``ci/releases.toml`` (``newest`` becomes the newest of them; ``--dry-run`` writes nothing
there), prints the sweep of every entry on them cut into ``--shards`` parts exactly as ``python -m ci.sweep
--release R --shard I/N`` cuts it, and writes the pull request's title and text (``--pr``) from what the sweep
file holds for them: "R: N of M bugs still present, K fixed", each new release R against the one before.
``report`` writes the same text once the parts are merged, with the notebook runs of ``--build``, and with
``--readme`` puts ``python -m ci.sweep --summary``'s block into the README.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from . import ROOT
RELEASES_FILE = ROOT / "ci" / "releases.toml"
INSTALL_ROOT = ROOT / ".deepspeed"
EXTENSIONS_ROOT = ROOT / ".cache" / "torch_extensions"
README = ROOT / "README.md"
UPDATE = ROOT / "build" / "release-update"  # where update and report write the pull request's text


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


def sample_releases() -> tuple[str, ...]:
    """The sweep's boundary releases (first/last affected, first fixed of every entry) outside the
    release set: the default test run re-checks them, so setup installs them too (no kernels)."""
    from fixes import measured

    release_set = set(load().releases)
    found = {release for sweep in measured.load().results.values() for release in sweep.boundaries}
    return tuple(sorted(found - release_set, key=lambda r: tuple(int(p) for p in r.split("."))))


def check_known(release: str) -> str:
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


def environment(release: str) -> dict[str, str]:
    """Variables that select ``release`` for a Python process (a kernel, a test's child)."""
    return {
        "PYTHONPATH": str(install_dir(release)),
        "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_ROOT / release),
        "FIXBOOK_DEEPSPEED_RELEASE": release,
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
    return subprocess.run([sys.executable, *args], env=env, timeout=timeout, cwd=ROOT, **kwargs)


def install(release: str) -> None:
    """``pip install --no-deps --target``, with ``DS_BUILD_OPS=0`` so nothing is compiled and
    ``--no-build-isolation`` so the build sees the venv's torch (DeepSpeed's setup.py imports it)
    and no other torch is ever downloaded. Installed to a temporary directory first, so an
    interrupted install never leaves a half release behind."""
    if is_installed(release):
        return
    INSTALL_ROOT.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{release}-", dir=INSTALL_ROOT))
    try:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(staging), f"deepspeed=={release}"],
                       env={**os.environ, "DS_BUILD_OPS": "0"}, check=True)
        shutil.rmtree(install_dir(release), ignore_errors=True)
        staging.rename(install_dir(release))
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
    for release in releases:
        write_kernel(release)
    print(f"DeepSpeed releases ready: {', '.join(releases)} (kernels: "
          f"{', '.join(kernel_name(r) for r in releases)}); sweep boundary releases: "
          f"{', '.join(sample_releases()) or 'none'}")


# ---- a new DeepSpeed release: add it, plan its sweep, say what changed -----------------------------------

class UpdateError(RuntimeError):
    """The index cannot be asked, or what it or the caller names is not a release (the message says which)."""


def release_key(release: str) -> tuple[int, ...]:
    """A final release number (``0.19.9``: DeepSpeed's are three numbers) as a comparable tuple; anything else is
    an :class:`UpdateError`."""
    if not re.fullmatch(r"\d+\.\d+\.\d+", release):
        raise UpdateError(f"not a final DeepSpeed release number: {release!r} (e.g. 0.19.9)")
    return tuple(int(part) for part in release.split("."))


def index_versions(index_url: str | None = None, timeout: float = 180) -> list[str]:
    """DeepSpeed's versions as pip's own index query lists them (``pip index versions deepspeed``: final
    releases, newest first). ``index_url``: ask that index alone (pip ``--isolated``: no configured extra index)."""
    command = [sys.executable, "-m", "pip", "index", "versions", "deepspeed", "--disable-pip-version-check"]
    if index_url:
        command += ["--isolated", "--index-url", index_url]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise UpdateError(f"`pip index versions deepspeed` gave no answer in {timeout:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise UpdateError(f"`pip index versions deepspeed` failed: {last}")
    for line in done.stdout.splitlines():
        if line.startswith("Available versions:"):
            return [v.strip() for v in line.partition(":")[2].split(",") if v.strip()]
    raise UpdateError(f"`pip index versions deepspeed` listed no versions: {done.stdout.strip()[:200]!r}")


def new_releases(available: list[str], release_set: ReleaseSet | None = None) -> list[str]:
    """The final releases of ``available`` newer than the set's ``newest``, oldest first (a pre-release, or any
    other version string pip lists, is left out)."""
    release_set = release_set or load()
    floor = release_key(release_set.newest)
    final = [r for r in available if re.fullmatch(r"\d+\.\d+\.\d+", r)]
    return sorted({r for r in final if release_key(r) > floor}, key=release_key)


def with_releases(text: str, added: list[str]) -> str:
    """``ci/releases.toml``'s text with ``added`` in ``releases`` and ``newest`` the newest of all (its comments
    kept)."""
    data = tomllib.loads(text)
    releases = sorted(set(data["releases"]) | set(added), key=release_key)
    newest = max([data["newest"], *added], key=release_key)
    text, newest_lines = re.subn(r'(?m)^newest = ".*"$', f'newest = "{newest}"', text)
    text, release_lines = re.subn(r"(?m)^releases = \[.*\]$",
                                  "releases = [" + ", ".join(f'"{r}"' for r in releases) + "]", text)
    if (newest_lines, release_lines) != (1, 1):
        raise UpdateError(f"{RELEASES_FILE}: expected one `newest = ...` line and one `releases = [...]` line")
    return text


def sweep_plan(added: list[str], count: int, sweep_file: Path | None = None) -> list[tuple[object, dict, str]]:
    """Every entry on every ``added`` release, cut into ``count`` parts as ``python -m ci.sweep --release R
    --shard I/N`` cuts it from ``sweep_file`` (default: the committed one): [(shard, its plan, how balanced)]."""
    import fixes
    from fixes import measured

    from . import shards, sweep

    whole = sweep.plan_for(fixes.available(), sorted(added, key=release_key))
    old = measured.read(sweep_file or measured.DATA)
    return [(shard, *sweep.shard_plan(whole, shard, old)) for shard in
            (shards.Shard(index, count) for index in range(1, count + 1))]


def _line(release: str, before: str, data, kind: str) -> tuple[str, list[str]]:  # noqa: ANN001 - SweepData
    """"<release>: N of M bugs still present, K fixed" for the entries of ``kind`` present on ``before``; and
    the details: which were fixed, which appeared, which could not be told."""
    import fixes

    entries = [fix.id for fix in fixes.all_fixes() if (fix.info.kind == "behaviour change") == (kind != "bug")]
    present = [e for e in entries if data.entry(e).expected_affected(before) is True]
    rows = {e: data.entry(e).get(release) for e in entries}
    kinds = kind if len(present) == 1 else f"{kind}s"
    if not any(rows.values()):
        return f"{release}: not swept yet ({len(present)} {kinds} present on {before} to measure)", []
    still = [e for e in present if rows[e] is not None and rows[e].status == "affected"]
    gone = [e for e in present if rows[e] is not None and rows[e].status == "not affected"]
    untold = [e for e in present if e not in still and e not in gone]
    appeared = [e for e in entries if e not in present and rows[e] is not None and rows[e].status == "affected"]
    verb = ("still present", "fixed") if kind == "bug" else ("still shown", "gone")
    line = f"{release}: {len(still)} of {len(present)} {kinds} {verb[0]}, {len(gone)} {verb[1]}"
    if untold:
        line += f", {len(untold)} not told (" + "; ".join(
            f"{e}: {rows[e].status if rows[e] else 'not swept'}" for e in untold) + ")"
    details = []
    if gone:
        details.append(f"{verb[1]} in {release}: " + ", ".join(f"`{e}`" for e in gone))
    if appeared:
        details.append(f"new in {release} (not present on {before}): " + ", ".join(f"`{e}`" for e in appeared))
    return line, details


def report(added: list[str], previous: str, sweep_file: Path | None = None, build: Path | None = None,
           command: str = "report") -> tuple[str, str]:
    """The pull request's (title, text) for ``added`` releases, each against the one before it (the first
    against ``previous``), from the sweep file and, where ``build`` holds them, the notebook runs."""
    from fixes import measured

    data = measured.read(sweep_file or measured.DATA)
    added = sorted(added, key=release_key)
    lines = [f"DeepSpeed {', '.join(added)} appeared on PyPI. This adds {'it' if len(added) == 1 else 'them'} to "
             "`ci/releases.toml` (every notebook runs on the newest release) and sweeps every entry on "
             f"{'it' if len(added) == 1 else 'them'}.", "", "## What changed", ""]
    title = ""
    for before, release in zip([previous, *added], added):
        for kind in ("bug", "behaviour change"):
            line, details = _line(release, before, data, kind)
            lines.append(f"- {line}" + ("" if "not swept" in line else f" (of those present on {before})"))
            lines.extend(f"  - {detail}" for detail in details)
            if kind == "bug":
                title = line
        affected = [(entry, sweep_.get(release)) for entry, sweep_ in data.results.items()
                    if sweep_.get(release) is not None and sweep_.get(release).status == "affected"]
        if affected:
            counts = {s: sum(row.fix == s for _, row in affected) for s in measured.FIX_STATUSES}
            lines.append(f"- fix coverage on {release}: the fix fixes {counts['fixed']} of the {len(affected)} affected "
                         "entries" + "".join(f"; {n} {s}" for s, n in counts.items() if n and s != "fixed"))
            lines.extend(f"  - `{entry}`: fix {row.fix}: {row.fix_reason}" for entry, row in affected
                         if row.fix not in (None, "fixed"))
    others = {name: sorted(part.results) for name, part in data.environments.items()
              if any(part.entry(e).get(r) is None for e in part.results for r in added)}
    for name, entries in sorted(others.items()):
        lines.append(f"- environment `{name}`: not swept on {', '.join(added)} here (`python -m ci.sweep --env {name} "
                     + " ".join(f"--entry {e}" for e in entries) + " " + " ".join(f"--release {r}" for r in added) + "`)")
    if build is not None and (build / "results").is_dir():
        from .runner import recorded_runs

        runs = recorded_runs(build)
        failed = [r for r in runs if not r.passed]
        on_new = [r for r in runs if r.release in added]
        lines += ["", "## Notebooks", "",
                  f"- {len(runs)} notebook runs of the matrix ({len(on_new)} on {', '.join(added)}): "
                  f"{len(runs) - len(failed)} passed, {len(failed)} failed"]
        lines.extend(f"  - `{r.entry}` on {r.release} ({r.environment}): cell {r.failed_cell}: {r.error}" for r in failed)
    lines += ["", f"Written by `python -m ci.releases {command}` (the workflow `release-update`)."]
    return f"DeepSpeed {', '.join(added)}: {title.partition(': ')[2]}", "\n".join(lines) + "\n"


SUMMARY_BLOCK = re.compile(r"(`python -m ci\.sweep --summary` prints what the\s+file holds; as committed it printed:\n\n"
                           r"```\n)(.*?)(\n```)", re.S)


def readme_with_summary(text: str, summary: str) -> str:
    """The README with ``summary`` (``python -m ci.sweep --summary``) as its quoted sweep block."""
    replaced, count = SUMMARY_BLOCK.subn(lambda m: m.group(1) + summary + m.group(3), text)
    if count != 1:
        raise UpdateError(f"{README}: found no block after 'as committed it printed:' to put the sweep's summary in")
    return replaced


def write_outputs(path: Path | None, values: dict[str, str]) -> None:
    """``key=value`` lines appended to ``path`` (a CI system's step outputs, e.g. ``$GITHUB_OUTPUT``)."""
    if path is not None:
        with open(path, "a") as handle:
            handle.writelines(f"{key}={value}\n" for key, value in values.items())


def _split(values: list[str] | None) -> list[str]:
    return [r for value in values or [] for r in re.split(r"[\s,]+", value) if r]


def update(args: argparse.Namespace) -> int:
    release_set = load()
    if args.sweep is not None and not args.sweep.is_file():
        print(f"ci.releases update: no sweep file {args.sweep}", file=sys.stderr)
        return 2
    try:
        asked = _split(args.release)
        for release in asked:
            release_key(release)
        added = new_releases(asked or index_versions(args.index_url), release_set)
    except UpdateError as exc:
        print(f"ci.releases update: {exc}", file=sys.stderr)
        return 2
    write_outputs(args.outputs, {"releases": " ".join(added)})
    if not added:
        print(f"nothing to add: no DeepSpeed release newer than {release_set.newest} "
              f"({'as given' if asked else 'on the index'})")
        return 0
    print(f"new DeepSpeed release(s): {', '.join(added)} (newest in {RELEASES_FILE.name}: {release_set.newest})")
    if args.check:
        return 0
    text = with_releases(RELEASES_FILE.read_text(), added)
    changed = [line for line in text.splitlines() if line not in RELEASES_FILE.read_text().splitlines()]
    if args.dry_run:
        print(f"--dry-run: {RELEASES_FILE.name} would read:\n  " + "\n  ".join(changed))
    else:
        RELEASES_FILE.write_text(text)
        print(f"{RELEASES_FILE.name} now reads:\n  " + "\n  ".join(changed))
    plan = sweep_plan(added, args.shards, args.sweep)
    rows = sum(len(e) for _, part, _ in plan for e in part.values())
    print(f"the sweep: {rows} rows (every entry on {', '.join(added)}) in {args.shards} part(s), each "
          f"`python -m ci.sweep {' '.join(f'--release {r}' for r in added)} --shard I/{args.shards}`:")
    for shard, part, method in plan:
        print(f"  part {shard}: {sum(map(len, part.values()))} rows (balanced by {method}): " +
              "; ".join(f"{release}: {', '.join(entries)}" for release, entries in part.items()))
    return _write_report(added, release_set.newest, args)


def _write_report(added: list[str], previous: str, args: argparse.Namespace) -> int:
    title, body = report(added, previous, args.sweep, args.build, args.command)
    args.pr.parent.mkdir(parents=True, exist_ok=True)
    args.pr.write_text(body)
    write_outputs(args.outputs, {"title": title})
    print(f"the pull request ({args.pr}):\n\n{title}\n\n{body}")
    return 0


def report_command(args: argparse.Namespace) -> int:
    try:
        added = sorted(_split(args.release), key=release_key)
    except UpdateError as exc:
        print(f"ci.releases report: {exc}", file=sys.stderr)
        return 2
    if not added:
        print("ci.releases report: --release R names the added release(s)", file=sys.stderr)
        return 2
    if args.sweep is not None and not args.sweep.is_file():
        print(f"ci.releases report: no sweep file {args.sweep}", file=sys.stderr)
        return 2
    from fixes import measured

    data = measured.read(args.sweep or measured.DATA)
    older = [r for r in data.releases if release_key(r) < release_key(added[0])]
    if not older:
        print(f"ci.releases report: the sweep file has no release before {added[0]} to compare with", file=sys.stderr)
        return 2
    if args.readme:
        from .sweep import summary

        README.write_text(readme_with_summary(README.read_text(), summary(data)))
        print(f"{README.name}: its sweep block is now `python -m ci.sweep --summary`'s")
    return _write_report(added, max(older, key=release_key), args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.releases", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["install", "list", "update", "report"])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--no-boundaries", action="store_true",
                        help="install: only the release set (what the notebooks run on), not the sweep boundaries")
    parser.add_argument("--dry-run", action="store_true", help="update: change no file of the checkout")
    parser.add_argument("--check", action="store_true",
                        help="update: only say which releases are new (and write them to --outputs)")
    parser.add_argument("--index-url", metavar="URL", help="update: ask this package index alone (default: pip's)")
    parser.add_argument("--release", action="append", metavar="R",
                        help="update: add R instead of asking the index; report: the added release (repeatable)")
    parser.add_argument("--shards", type=int, default=3, help="update: the sweep's parts (default 3)")
    parser.add_argument("--sweep", type=Path, help="the sweep file to read (default: fixes/data/sweep.json)")
    parser.add_argument("--build", type=Path, help="report: the merged notebook runs to report")
    parser.add_argument("--pr", type=Path, default=UPDATE / "pr.md", help="where the pull request's text goes")
    parser.add_argument("--outputs", type=Path, metavar="FILE",
                        help="append releases=... and title=... to FILE (e.g. $GITHUB_OUTPUT)")
    parser.add_argument("--readme", action="store_true", help="report: put the sweep's summary into README.md")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error("--shards takes a count of parts, 1 or more")
    if args.command == "update":
        return update(args)
    if args.command == "report":
        return report_command(args)
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
