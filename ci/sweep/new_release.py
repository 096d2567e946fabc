"""A new DeepSpeed release on PyPI: add it to the release set, plan its sweep in parts, and say what changed.

    python -m ci.sweep.new_release update [--dry-run]
        # a DeepSpeed release on PyPI newer than ci/releases.toml's newest: add it, plan its sweep in shards,
        # write the pull request's text
    python -m ci.sweep.new_release update --check --outputs FILE            # only say which releases are new (stdlib, pip)
    python -m ci.sweep.new_release report --release R --build DIR --readme  # after the sweep and the notebooks

``update`` asks the index with pip's own query (``pip index versions deepspeed``; ``--index-url URL`` asks that
index alone) and takes every final release newer than ``newest``; ``--release R`` takes R instead of asking.
It adds them to ``ci/releases.toml`` (``newest`` becomes the newest of them; ``--dry-run`` writes nothing
there), prints the sweep of every entry on them cut into ``--shards`` parts exactly as ``python -m ci.sweep
--release R --shard I/N`` cuts it, and writes the pull request's title and text (``--pr``) from what the sweep
file holds for them: "R: N of M bugs still present, K fixed", each new release R against the one before.
``report`` writes the same text once the parts are merged, with the notebook runs of ``--build``, and with
``--readme`` puts ``python -m ci.sweep --summary``'s block into the README.

It sits in the sweep's package, above the runner, since it builds on both (and on the release set, ``ci.releases``).
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from .. import ROOT
from .. import releases as release_package  # the package, read at call time (a test points it at a copy)

README = ROOT / "README.md"
UPDATE = ROOT / "build" / "release-update"  # where update and report write the pull request's text


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


def new_releases(available: list[str], release_set: release_package.ReleaseSet | None = None) -> list[str]:
    """The final releases of ``available`` newer than the set's ``newest``, oldest first (a pre-release, or any
    other version string pip lists, is left out)."""
    release_set = release_set or release_package.load()
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
        raise UpdateError(f"{release_package.RELEASES_FILE}: expected one `newest = ...` line and one `releases = [...]` line")
    return text


def sweep_plan(added: list[str], count: int, sweep_file: Path | None = None) -> list[tuple[object, dict, str]]:
    """Every entry on every ``added`` release, cut into ``count`` parts as ``python -m ci.sweep --release R
    --shard I/N`` cuts it from ``sweep_file`` (default: the committed one): [(shard, its plan, how balanced)]."""
    import fixes
    from fixes import measured

    from ..notebooks import shards
    from .. import sweep

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
        from ..notebooks.runner import recorded_runs

        runs = recorded_runs(build)
        failed = [r for r in runs if not r.passed]
        on_new = [r for r in runs if r.release in added]
        lines += ["", "## Notebooks", "",
                  f"- {len(runs)} notebook runs of the matrix ({len(on_new)} on {', '.join(added)}): "
                  f"{len(runs) - len(failed)} passed, {len(failed)} failed"]
        lines.extend(f"  - `{r.entry}` on {r.release} ({r.environment}): cell {r.failed_cell}: {r.error}" for r in failed)
    lines += ["", f"Written by `python -m ci.sweep.new_release {command}` (the workflow `release-update`)."]
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
    release_set = release_package.load()
    if args.sweep is not None and not args.sweep.is_file():
        print(f"ci.sweep.new_release update: no sweep file {args.sweep}", file=sys.stderr)
        return 2
    try:
        asked = _split(args.release)
        for release in asked:
            release_key(release)
        added = new_releases(asked or index_versions(args.index_url), release_set)
    except UpdateError as exc:
        print(f"ci.sweep.new_release update: {exc}", file=sys.stderr)
        return 2
    write_outputs(args.outputs, {"releases": " ".join(added)})
    if not added:
        print(f"nothing to add: no DeepSpeed release newer than {release_set.newest} "
              f"({'as given' if asked else 'on the index'})")
        return 0
    print(f"new DeepSpeed release(s): {', '.join(added)} (newest in {release_package.RELEASES_FILE.name}: {release_set.newest})")
    if args.check:
        return 0
    text = with_releases(release_package.RELEASES_FILE.read_text(), added)
    changed = [line for line in text.splitlines() if line not in release_package.RELEASES_FILE.read_text().splitlines()]
    if args.dry_run:
        print(f"--dry-run: {release_package.RELEASES_FILE.name} would read:\n  " + "\n  ".join(changed))
    else:
        release_package.RELEASES_FILE.write_text(text)
        print(f"{release_package.RELEASES_FILE.name} now reads:\n  " + "\n  ".join(changed))
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
        print(f"ci.sweep.new_release report: {exc}", file=sys.stderr)
        return 2
    if not added:
        print("ci.sweep.new_release report: --release R names the added release(s)", file=sys.stderr)
        return 2
    if args.sweep is not None and not args.sweep.is_file():
        print(f"ci.sweep.new_release report: no sweep file {args.sweep}", file=sys.stderr)
        return 2
    from fixes import measured

    data = measured.read(args.sweep or measured.DATA)
    older = [r for r in data.releases if release_key(r) < release_key(added[0])]
    if not older:
        print(f"ci.sweep.new_release report: the sweep file has no release before {added[0]} to compare with", file=sys.stderr)
        return 2
    if args.readme:
        from . import summary

        README.write_text(readme_with_summary(README.read_text(), summary(data)))
        print(f"{README.name}: its sweep block is now `python -m ci.sweep --summary`'s")
    return _write_report(added, max(older, key=release_key), args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.sweep.new_release", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["update", "report"])
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
    return update(args) if args.command == "update" else report_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
