"""Record the fingerprints of an entry's targets across the installed DeepSpeed releases.

    python -m ci.sweep.fingerprints ENTRY                   # show each installed release's fingerprints
    python -m ci.sweep.fingerprints ENTRY --release 0.16.0  # only these releases (repeatable)
    python -m ci.sweep.fingerprints ENTRY --write           # record them for the releases the probe calls affected

Each release runs in its own child process (one DeepSpeed per process). For every target of the
entry the child reports the fingerprint of the installed code, and whether the entry's probe (in its
``measurement_context()``) finds the bug there. ``--write`` adds the fingerprints of the releases
the probe calls affected to ``fixes/data/fingerprints.json`` (``--replace``: instead of the entry's
recorded ones); ``apply()`` then accepts that code. Record only code the fix was verified on: the
sweep (``python -m ci.sweep --entry ENTRY``) then measures whether the fix applies *and fixes* there.
"""
from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fixes import fingerprints
from fixes.versions import parse

from .. import releases as release_env

MARK = "FIXBOOK-FINGERPRINTS "


@dataclass
class Observed:
    """One entry's targets on one release."""

    release: str
    entry: str
    affected: bool | None = None
    fingerprints: dict[str, str] = field(default_factory=dict)  # target -> fingerprint
    sources: dict[str, str] = field(default_factory=dict)  # target -> source (for the cross-Python test)
    missing: dict[str, str] = field(default_factory=dict)  # target -> why it has no fingerprint here
    error: str = ""


def child_main(entry_ids: list[str]) -> int:
    """Inside one release: print one marked JSON line per entry."""
    import fixes

    for entry_id in entry_ids:
        fix = fixes.get(entry_id)
        answer: dict[str, object] = {"entry": entry_id, "fingerprints": {}, "sources": {}, "missing": {}}
        for target in fix.targets:
            try:
                source = target.source()
            except Exception as exc:  # noqa: BLE001 - a target absent on this release is a finding
                answer["missing"][target.dotted] = f"{type(exc).__name__}: {exc}"  # type: ignore[index]
                continue
            answer["sources"][target.dotted] = source  # type: ignore[index]
            answer["fingerprints"][target.dotted] = fingerprints.fingerprint_source(source)  # type: ignore[index]
        try:
            with fix.measurement_context():
                answer["affected"] = fix.probe().affected
        except Exception as exc:  # noqa: BLE001
            answer["error"] = f"probe: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        print(MARK + json.dumps(answer), flush=True)
    return 0


def observe(release: str, entries: list[str], timeout: float = 300) -> list[Observed]:
    """Every entry's targets on ``release`` (a child process)."""
    done = release_env.run_python_any(release, ["-m", "ci.sweep.fingerprints", "--child", *entries],
                                      timeout=timeout, capture_output=True, text=True,
                                      extra_env={"DS_ACCELERATOR": "cpu"})
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            data = json.loads(line[len(MARK):])
            found[data["entry"]] = Observed(release, data["entry"], data.get("affected"), data["fingerprints"],
                                            data["sources"], data["missing"], data.get("error", ""))
    failure = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1] if done.returncode else ""
    return [found.get(entry) or Observed(release, entry, error=failure or "no answer") for entry in entries]


def observe_all(releases: list[str], entries: list[str], jobs: int = 2) -> list[Observed]:
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return [o for batch in pool.map(lambda r: observe(r, entries), releases) for o in batch]


def merged(entry: str, observed: list[Observed], replace: bool = False) -> dict[str, dict[str, list[str]]]:
    """The entry's record with the fingerprints of the affected releases in ``observed`` added."""
    record: dict[str, dict[str, set[str]]] = {}
    if not replace:
        for target, known in fingerprints.recorded(entry).items():
            record[target] = {fp: set(rels) for fp, rels in known.items()}
    for o in observed:
        if o.entry != entry or not o.affected:
            continue
        for target, fp in o.fingerprints.items():
            record.setdefault(target, {}).setdefault(fp, set()).add(o.release)
    return {target: {fp: sorted(rels, key=parse) for fp, rels in known.items()} for target, known in record.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.sweep.fingerprints", description=__doc__.splitlines()[0])
    parser.add_argument("entry", nargs="*", help="entry id(s)")
    parser.add_argument("--release", action="append", help="release (repeatable; default: every installed one)")
    parser.add_argument("--write", action="store_true", help="record the affected releases' fingerprints")
    parser.add_argument("--replace", action="store_true", help="with --write: drop the entry's old record first")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    import fixes

    if not args.entry:
        parser.error("name at least one entry (fixbook list shows them)")
    entries = [fixes.get(e).id for e in args.entry]
    chosen = sorted(set(args.release or release_env.installed_releases()), key=parse)
    for release in chosen:
        if not release_env.is_installed(release):
            parser.error(f"DeepSpeed {release} is not installed in {release_env.INSTALL_ROOT} "
                         f"(python -m ci.sweep --release {release} installs it)")
    observed = observe_all(chosen, entries, args.jobs)
    for entry in entries:
        known = fingerprints.recorded(entry)
        print(f"{entry}:")
        for o in sorted((o for o in observed if o.entry == entry), key=lambda o: parse(o.release)):
            state = "error: " + o.error if o.error else ("affected" if o.affected else "not affected")
            cells = [f"{fp}{'' if fp in known.get(t, {}) else ' (new)'}" for t, fp in sorted(o.fingerprints.items())]
            cells += [f"{t.rsplit('.', 1)[-1]} missing" for t in sorted(o.missing)]
            print(f"  {o.release:<8} {state:<13} " + "  ".join(cells))
        if args.write:
            fingerprints.write_entry(entry, merged(entry, observed, args.replace))
            print(f"  recorded in {fingerprints.RECORD.relative_to(release_env.ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
