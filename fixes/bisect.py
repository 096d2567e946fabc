"""``fixbook bisect``: which DeepSpeed releases a user's own reproduction script affects.

    fixbook bisect repro.py [--since 0.14.4] [--good REL] [--bad REL] [--python PY] [--jobs N]
                            [--marker TEXT] [--timeout S] [--json FILE] [--cache DIR] [--offline]

The script is run once per chosen release, in a fresh process with that release importable (each
release installed once into a cache directory with ``pip install --no-deps --target``,
``DS_BUILD_OPS=0``: nothing is compiled and the user's torch is never replaced). Its exit status
says what it found: 0 the bug is absent, 1 it is present; anything else (a crash, a signal, a
timeout) is *could not run*, never *present*. With ``--marker TEXT`` the bug is present when TEXT is
in the script's output and absent otherwise (a crash is still *could not run*).

The releases are the final (non pre-release) releases on PyPI from ``--since`` on (with
``--offline``, those already in the cache). Bisection samples a grid of them, halves every interval
whose ends disagree until the change is between two neighbouring releases, then runs the
neighbours of each boundary to confirm it: far fewer runs than trying every release. Releases
between two runs that agree are taken to agree (the premise of any bisection); the table says which
releases actually ran. A Ctrl-C stops the runs and reports what finished.

The cache has the layout ``ci.sweep`` uses (``<cache>/<release>/``), so pointing ``--cache`` at a
checkout's ``.deepspeed`` shares its installs.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Literal

from .exceptions import FixbookError
from .versions import parse

Outcome = Literal["present", "absent", "could not run"]
DEFAULT_CACHE = Path(os.environ.get("FIXBOOK_CACHE", Path.home() / ".cache" / "fixbook" / "deepspeed"))


class BisectError(FixbookError):
    """Bad input to ``fixbook bisect`` (no script, no release to run, a good/bad outside the list)."""


@dataclass(frozen=True)
class Run:
    release: str
    outcome: Outcome
    seconds: float
    detail: str = ""  # why it could not run, or the marker line


@dataclass
class Bisection:
    """The releases considered and the runs made; the verdict for every release by bisection."""

    releases: list[str]
    runs: dict[str, Run] = field(default_factory=dict)
    interrupted: bool = False

    def verdict(self, release: str) -> Outcome | None:
        """The run's outcome, or, between two runs that agree, theirs; None where it is not known."""
        if release in self.runs:
            return self.runs[release].outcome
        index = self.releases.index(release)
        below = next((self.runs[r].outcome for r in reversed(self.releases[:index])
                      if r in self.runs and self.runs[r].outcome != "could not run"), None)
        above = next((self.runs[r].outcome for r in self.releases[index + 1:]
                      if r in self.runs and self.runs[r].outcome != "could not run"), None)
        return below if below is not None and below == above else None

    @property
    def ranges(self) -> list[tuple[str, str]]:
        """Runs of consecutive releases judged present."""
        found: list[tuple[str, str]] = []
        start = previous = None
        for release in self.releases:
            if self.verdict(release) == "present":
                start = start or release
                previous = release
            elif start:
                found.append((start, previous))  # type: ignore[arg-type]
                start = previous = None
        if start:
            found.append((start, previous))  # type: ignore[arg-type]
        return found

    @property
    def first_affected(self) -> str | None:
        return self.ranges[0][0] if self.ranges else None

    @property
    def last_affected(self) -> str | None:
        return self.ranges[-1][1] if self.ranges else None

    @property
    def first_fixed(self) -> str | None:
        last = self.last_affected
        if last is None:
            return None
        later = self.releases[self.releases.index(last) + 1:]
        return next((r for r in later if self.verdict(r) == "absent"), None)

    @property
    def summary(self) -> str:
        if not self.ranges:
            text = "not affected on any release that ran"
        else:
            text = "affected " + ", ".join(a if a == b else f"{a} – {b}" for a, b in self.ranges)
            text += f"; first fixed {self.first_fixed}" if self.first_fixed else "; not fixed in the newest release"
        unknown = [r for r in self.releases if self.verdict(r) is None]
        if unknown:
            text += f"; unknown: {', '.join(unknown)}"
        cannot = [r for r, run in self.runs.items() if run.outcome == "could not run"]
        if cannot:
            text += f"; could not run on {', '.join(sorted(cannot, key=parse))}"
        return text + f" ({len(self.runs)} runs for {len(self.releases)} releases)" + (
            "; interrupted" if self.interrupted else "")

    def to_json(self) -> dict:
        return {"releases": self.releases, "runs": [asdict(r) for r in self.runs.values()], "summary": self.summary,
                "first_affected": self.first_affected, "last_affected": self.last_affected,
                "first_fixed": self.first_fixed, "interrupted": self.interrupted}


def bisect(releases: list[str], probe: Callable[[str], Run], known: dict[str, Outcome] | None = None,
           jobs: int = 1, progress: Callable[[Run, int], None] | None = None) -> Bisection:
    """Find where ``probe``'s answer changes over ``releases`` (oldest first) with few probes.

    ``known``: outcomes given by the user (``--good``/``--bad``), not run. A Ctrl-C stops
    probing; the result holds the runs that finished (``interrupted``)."""
    result = Bisection(list(releases))
    for release, outcome in (known or {}).items():
        result.runs[release] = Run(release, outcome, 0.0, "given")

    def run_all(chosen: list[str]) -> None:
        todo = [r for r in dict.fromkeys(chosen) if r not in result.runs]
        if not todo:
            return
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for run in pool.map(probe, todo):
                result.runs[run.release] = run
                if progress:
                    progress(run, len(result.runs))

    try:
        n = len(releases)
        step = max(1, round(math.sqrt(n)))
        run_all([releases[i] for i in range(0, n, step)] + [releases[-1]])
        while step > 1 and len({run.outcome for run in result.runs.values() if run.outcome != "could not run"}) <= 1:
            # Every sampled release agrees: a range narrower than the step can hide between two samples
            # (e.g. 3 affected releases among 19). Sample twice as densely, down to every release,
            # until one disagrees; a verdict of "no change" therefore rests on every release.
            step = max(1, step // 2)
            run_all([releases[i] for i in range(0, n, step)])
        while True:
            ran = [r for r in releases if r in result.runs and result.runs[r].outcome != "could not run"]
            split = []
            for low, high in zip(ran, ran[1:]):
                if result.runs[low].outcome == result.runs[high].outcome:
                    continue
                between = [r for r in releases[releases.index(low) + 1:releases.index(high)] if r not in result.runs]
                if between:
                    split.append(between[len(between) // 2])
            if not split:
                break
            run_all(split)
        # confirm each boundary: the release on either side of it beyond the pair that showed it
        ran = [r for r in releases if r in result.runs and result.runs[r].outcome != "could not run"]
        confirm = []
        for low, high in zip(ran, ran[1:]):
            if result.runs[low].outcome != result.runs[high].outcome:
                i, j = releases.index(low), releases.index(high)
                confirm += [releases[k] for k in (i - 1, j + 1) if 0 <= k < n]
        run_all(confirm)
    except KeyboardInterrupt:
        result.interrupted = True
    return result


# ---- the releases, their installs, one run ------------------------------------------------------------

def final_releases(since: str, cache: Path, offline: bool) -> list[str]:
    """Final releases ≥ ``since``: from PyPI, or (``offline``) those in the cache."""
    if offline:
        found = [p.name for p in cache.iterdir() if (p / f"deepspeed-{p.name}.dist-info").is_dir()] if cache.is_dir() else []
    else:
        with urllib.request.urlopen("https://pypi.org/pypi/deepspeed/json", timeout=60) as response:
            data = json.load(response)
        found = [v for v, files in data["releases"].items() if files and not any(f.get("yanked") for f in files)]
    final = [v for v in found if re.fullmatch(r"\d+\.\d+\.\d+", v) and parse(v) >= parse(since)]
    return sorted(final, key=parse)


def install(release: str, cache: Path, python: str) -> Path:
    """``<cache>/<release>``, installed once (an interrupted install leaves nothing behind)."""
    target = cache / release
    if (target / f"deepspeed-{release}.dist-info").is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{release}-", dir=cache))
    try:
        subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target",
                        str(staging), f"deepspeed=={release}"], env={**os.environ, "DS_BUILD_OPS": "0"}, check=True,
                       capture_output=True, text=True)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def run_script(script: Path, release: str, cache: Path, python: str, timeout: float, marker: str | None) -> Run:
    started = time.monotonic()
    try:
        target = install(release, cache, python)
    except subprocess.CalledProcessError as exc:
        return Run(release, "could not run", time.monotonic() - started, f"install failed: {exc.stderr[-300:]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "DS_BUILD_OPS": "0"}
    try:
        done = subprocess.run([python, str(script)], env=env, capture_output=True, text=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return Run(release, "could not run", time.monotonic() - started, f"timed out after {timeout:.0f} s")
    seconds = time.monotonic() - started
    output = done.stdout + done.stderr
    if marker is not None:
        if done.returncode not in (0, 1) and marker not in output:
            return Run(release, "could not run", seconds, _tail(output, done.returncode))
        return Run(release, "present" if marker in output else "absent", seconds,
                   next((line for line in output.splitlines() if marker in line), "")[:200])
    if done.returncode == 0:
        return Run(release, "absent", seconds)
    if done.returncode == 1:
        return Run(release, "present", seconds)
    return Run(release, "could not run", seconds, _tail(output, done.returncode))


def _tail(output: str, code: int) -> str:
    last = next((line for line in reversed(output.splitlines()) if line.strip()), "")
    what = f"signal {-code}" if code < 0 else f"exit {code}"
    return f"{what}: {last[:200]}"


def similar_entries(result: Bisection) -> list[tuple[str, str]]:
    """Entries whose measured sweep agrees with every run that gave an answer and shows the bug on
    at least one of them: (id, measured range)."""
    from . import registry

    decided = {r: run.outcome for r, run in result.runs.items() if run.outcome != "could not run"}
    found = []
    for fix in registry.all_fixes():
        sweep = fix.info.sweep
        agree = [sweep.expected_affected(r) == (outcome == "present") for r, outcome in decided.items()
                 if sweep.expected_affected(r) is not None]
        if agree and all(agree) and any(o == "present" for r, o in decided.items() if sweep.expected_affected(r)):
            found.append((fix.id, sweep.range_text))
    return found


def table(result: Bisection) -> str:
    rows = [f"{'release':<9} {'verdict':<14} how"]
    for release in result.releases:
        run = result.runs.get(release)
        verdict = result.verdict(release) or "unknown"
        if run is None:
            how = "by bisection (between two runs that agree)" if verdict != "unknown" else "not run"
        elif run.detail == "given":
            how = "given (--good/--bad)"
        else:
            how = f"ran, {run.seconds:.0f} s" + (f" ({run.detail})" if run.detail else "")
        rows.append(f"{release:<9} {verdict:<14} {how}")
    return "\n".join(rows)
