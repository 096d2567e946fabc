"""The release sweep: every entry's fast checks on every DeepSpeed release from 0.14.4 to the newest.

    python -m ci.sweep                                   # every entry × every release on PyPI ≥ 0.14.4
    python -m ci.sweep --entry ID --release 0.18.2       # a part (repeatable); merged into the file
    python -m ci.sweep --jobs 2 --timeout 240
    python -m ci.sweep --resume                          # only rows missing, could-not-run, or of changed entry code
    python -m ci.sweep --coverage --entry ID             # only the fix coverage of the recorded affected rows
    python -m ci.sweep --summary                         # what the file says
    python -m ci.sweep --env torch-2.0 --entry ID        # in another environment of ci/environments.toml
    python -m ci.sweep --shard 2/3                       # part 2 of 3 of the plan (ci.notebooks.shards), for machines side by side
    python -m ci.sweep --merge part1.json part2.json part3.json   # the parts' rows into --out, as if unsharded

Each release runs in one child process with that release selected (DeepSpeed is imported once);
for each entry it calls the code probe and the behavioural check (``Fix.reproduce()``), both inside
the entry's ``measurement_context()``; where both find the bug it applies the entry's fix, runs the
check again with the fix in place (ranks it launches apply it too) and reverts it: the fix's
*coverage* on that release (fixed / not fixed / refused / could not run). It prints a JSON line. An entry that crashes or hangs the
child is re-run alone under its own timeout, so it is recorded against that entry only. The parent
classifies each answer (:func:`fixes.measured.classify`), shows a progress bar, and writes ``fixes/data/sweep.json``
(rows of a partial sweep replace their old values; the rest is kept). Releases are installed once
into ``.deepspeed/<release>`` and reused by later sweeps.

Nothing measured is lost: each release's rows are merged into the file as soon as they are in (an
atomic write), a Ctrl-C ends every child and keeps what finished, and one sweep at a time may write
a file (a second refuses, naming the first). Every row records the entry code it was measured with
(:func:`fixes.measured.entry_code`: the entry module and its recorded fingerprints), so ``--resume``
after an interrupt or an edit measures only what is missing or stale.

``--env NAME`` runs the children with the Python of environment ``NAME`` (``ci/environments.toml``,
built by ``python -m ci.releases.environments install``) instead of the project venv's. Every row records its
environment; rows of another environment are kept apart in the file (``SweepData.environments``), so
they never replace the default ``cpu`` rows the ranges are derived from.

``--shard I/N`` measures part I of N of the plan and writes it into ``--out`` as usual, its ``last_run`` saying
which part, of which plan (a digest), and which rows it measured. The parts are cut from the plan and the file
at ``--out`` alone (give every part the same file, e.g. the committed one): whole releases, balanced by the
recorded seconds of their rows, when the plan has at least N releases; (release, entry) pairs otherwise (a new
release's sweep), so every part has work; by count where a row has no recorded seconds (:mod:`ci.notebooks.shards`).
``--merge`` takes the finished parts' files, checks that they are every part of one plan, each once, and
merges their rows into ``--out`` with one ``last_run``: the file the unsharded sweep writes.

Package ``ci.sweep``: measuring releases. The sweep (here), the triggers' grids (``triggers.py``:
``python -m ci.sweep.triggers``), the fingerprints of a fix's targets (``fingerprints.py``:
``python -m ci.sweep.fingerprints``) and a new DeepSpeed release on PyPI (``new_release.py``:
``python -m ci.sweep.new_release update|report``).
May import: ``ci.notebooks``, ``ci.releases``, ``ci.processes`` and ``fixes``.
"""
from __future__ import annotations

import argparse
import dataclasses
import fcntl
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from fixes import measured
from fixes.versions import SWEEP_SINCE, parse

from ..releases import environments
from .. import releases as release_env
from ..notebooks import shards
from ..processes import zygote

SINCE = SWEEP_SINCE  # 0.14.4: older releases do not import, or need Intel's extension, with the venv's torch
PYPI = "https://pypi.org/pypi/deepspeed/json"
MARK = "FIXBOOK-SWEEP "


def pypi_releases(since: str = SINCE, url: str = PYPI, timeout: float = 30) -> list[str]:
    """Final, not fully yanked DeepSpeed releases on PyPI from ``since`` on, oldest first."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        files = json.load(response)["releases"]
    chosen = [release for release, dists in files.items()
              if dists and not all(d.get("yanked") for d in dists)
              and not parse(release).is_prerelease and parse(release) >= parse(since)]
    return sorted(chosen, key=parse)


@dataclass(frozen=True)
class Pair:
    entry: str
    release: str


def child_main(entry_ids: list[str], coverage_only: bool = False) -> int:
    """Run inside one release's process: probe and reproduce each entry in turn, printing marked
    JSON lines. An entry whose check raises is reported and the next one runs. ``coverage_only``:
    the bug was measured already; probe, then measure the fix only."""
    from ..processes.kernel_server import start_rank_server

    start_rank_server()  # before anything is set up: the ranks' launches fork from this state
    import fixes
    from fixes import harness

    harness.setup()
    if coverage_only:
        for entry_id in entry_ids:
            fix = fixes.get(entry_id)
            answer: dict[str, object] = {"entry": entry_id}
            started = time.monotonic()
            try:
                with fix.measurement_context():
                    answer["probe"] = fix.probe().affected
                    answer.update(coverage(fix) if answer["probe"] else
                                  {"fix": "could not run", "fix_reason": "the probe no longer finds the bug"})
            except Exception as exc:  # noqa: BLE001
                answer.update(fix="could not run", fix_reason=_line(exc))
            answer.update(done=True, seconds=round(time.monotonic() - started, 1))
            print(MARK + json.dumps(answer), flush=True)
        return 0
    for entry_id in entry_ids:
        fix = fixes.get(entry_id)
        answer: dict[str, object] = {"entry": entry_id, "probe": None, "reproduced": None, "evidence": "",
                                     "done": False}
        started = time.monotonic()
        try:
            with fix.measurement_context():
                probe = fix.probe()
                answer.update(probe=probe.affected, evidence=probe.evidence)
                print(MARK + json.dumps(answer), flush=True)  # the probe's answer survives a crash below
                answer["reproduced"] = fix.reproduce()
                if probe.affected and answer["reproduced"] is not False:
                    print(MARK + json.dumps(answer), flush=True)
                    answer.update(coverage(fix))
        except Exception as exc:  # noqa: BLE001 - any failure is this entry's "could not run"
            answer["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        answer.update(done=True, seconds=round(time.monotonic() - started, 1))
        print(MARK + json.dumps(answer), flush=True)
    return 0


def _line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def coverage(fix) -> dict[str, str]:  # noqa: ANN001 - a fixes.Fix, imported in the child only
    """Apply ``fix`` (with what it requires), run its behavioural check again, revert: whether the fix
    applies *and fixes* on the installed release."""
    import fixes

    try:
        [outcome] = fixes.apply(fix.id)
    except fixes.DriftError as exc:
        return {"fix": "refused", "fix_reason": _line(exc)}
    except Exception as exc:  # noqa: BLE001
        return {"fix": "could not run", "fix_reason": f"apply() raised {_line(exc)}"}
    try:
        if outcome.action != "applied":
            return {"fix": "not fixed", "fix_reason": f"apply() said {outcome.action}: {outcome.message}"[:300]}
        still = fix.reproduce()
        if still is None:
            still = fix.probe().affected
        return {"fix": "not fixed" if still else "fixed", "fix_reason": outcome.message[:300]}
    except Exception as exc:  # noqa: BLE001
        return {"fix": "could not run", "fix_reason": f"the check with the fix applied raised {_line(exc)}"}
    finally:
        fixes.revert(fix.id)


def _answers(stdout: str) -> dict[str, dict[str, object]]:
    """The last marked line of each entry in a child's output."""
    found: dict[str, dict[str, object]] = {}
    for line in stdout.splitlines():
        if line.startswith(MARK):
            answer = json.loads(line[len(MARK):])
            found[str(answer["entry"])] = answer
    return found


def _failure_reason(stderr: str, returncode: int) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    last = (errors or lines or [f"exit code {returncode}"])[-1]
    if returncode < 0:
        last = f"killed by signal {-returncode}; last error: {last}"
    return last[:300]


def observe(release: str, answer: dict[str, object] | None, failure: str) -> measured.Observation:
    """Classify one entry's answer from a child (``failure``: why the child ended early, if it did). Its reasons
    name paths relative to the checkout (a traceback's ``/home/me/fixbook/.deepspeed/...`` is recorded as
    ``.deepspeed/...``): the record is published, and no machine path may reach a page."""
    observed = _observe(release, answer, failure)
    return dataclasses.replace(observed, reason=without_checkout(observed.reason),
                               fix_reason=without_checkout(observed.fix_reason))


def without_checkout(text: str) -> str:
    """``text`` with this checkout's absolute path taken out of every path it names."""
    return text.replace(f"{release_env.ROOT}{os.sep}", "") if text else text


def _observe(release: str, answer: dict[str, object] | None, failure: str) -> measured.Observation:
    if answer is None:
        return measured.Observation(release, "could not run", reason=failure or "no answer")
    probe = answer.get("probe")
    seconds = answer.get("seconds")
    if not answer.get("done") or answer.get("error"):
        return measured.Observation(release, "could not run", probe=probe,  # type: ignore[arg-type]
                                    reason=str(answer.get("error") or failure), seconds=seconds)  # type: ignore[arg-type]
    reproduced = answer.get("reproduced")
    status, why = measured.classify(probe, reproduced)  # type: ignore[arg-type]
    fix, fix_reason = answer.get("fix"), str(answer.get("fix_reason", ""))
    if status == "affected" and fix is None:
        fix, fix_reason = "could not run", "the fix was not measured (the check with it applied did not finish)"
    return measured.Observation(release, status, probe=probe, reproduced=reproduced,  # type: ignore[arg-type]
                                reason=why or str(answer.get("evidence", ""))[:300], seconds=seconds,  # type: ignore[arg-type]
                                fix=fix if status == "affected" else None,  # type: ignore[arg-type]
                                fix_reason=fix_reason if status == "affected" else "")


_ENVIRONMENTS: dict[str, "environments.Environment"] = {}  # resolved once per sweep (main), not per child
_CHILDREN: set[subprocess.Popen] = set()
_CHILDREN_LOCK = threading.Lock()
_STOP = threading.Event()  # set on Ctrl-C: no child starts after it


def _kill(proc: subprocess.Popen) -> None:
    """End a child and everything it started (the ranks it launched share its process group)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop_children() -> None:
    _STOP.set()
    with _CHILDREN_LOCK:
        for proc in list(_CHILDREN):
            _kill(proc)


def run_tracked(command: list[str], env: dict[str, str], timeout: float) -> tuple[str, str]:
    """Run one measuring child (in its own process group, ended with everything it started on a timeout or on
    :func:`stop_children`): (its stdout, why it ended early or ""). Shared by the sweep and the differential sweep."""
    if _STOP.is_set():
        return "", "interrupted"
    proc = subprocess.Popen(command, env=env, cwd=release_env.ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, process_group=0)
    with _CHILDREN_LOCK:
        _CHILDREN.add(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill(proc)
        stdout, _ = proc.communicate()
        return stdout, f"timed out after {timeout:.0f} s"
    finally:
        with _CHILDREN_LOCK:
            _CHILDREN.discard(proc)
    if _STOP.is_set():
        return stdout, "interrupted"
    return stdout, _failure_reason(stderr, proc.returncode) if proc.returncode != 0 else ""


def run_child(release: str, entries: list[str], timeout: float, coverage_only: bool = False,
              environment: str = measured.DEFAULT_ENVIRONMENT) -> tuple[dict[str, dict[str, object]], str]:
    """One child process under ``release`` for ``entries``: (answers by entry, why it ended early or "").
    The child gets its own process group, so a terminal's Ctrl-C reaches the parent only, which then
    ends every child (:func:`stop_children`). ``environment``: whose Python runs it (default: this one)."""
    if _STOP.is_set():
        return {}, "interrupted"
    if environment == measured.DEFAULT_ENVIRONMENT:
        python, selected = sys.executable, {**release_env.environment(release), "DS_ACCELERATOR": "cpu"}
    else:
        chosen = _ENVIRONMENTS.get(environment) or environments.require(environment)
        python, selected = str(chosen.executable), environments.variables(chosen, release)
    env = {**os.environ, **selected}
    flag = "--child-coverage" if coverage_only else "--child"
    stdout, failure = run_tracked([*zygote.command(python, env), "-m", "ci.sweep", flag, *entries], env, timeout)
    return _answers(stdout), failure


def run_release(release: str, entries: list[str], timeout: float,
                environment: str = measured.DEFAULT_ENVIRONMENT) -> dict[str, measured.Observation]:
    """Every entry on one release. They share one child (DeepSpeed is imported once); if that child
    dies or times out, each entry it did not finish runs again alone, so one entry's crash or hang
    is recorded against that entry only. ``timeout`` is per entry. The rows carry ``environment``."""
    # the environment is passed only where it is not the default: run_child(release, entries, timeout) stays the call
    child = run_child if environment == measured.DEFAULT_ENVIRONMENT else (
        lambda *args: run_child(*args, environment=environment))
    answers, failure = child(release, entries, timeout * len(entries))
    unfinished = [e for e in entries if not answers.get(e, {}).get("done")]
    if failure and unfinished:
        for entry in unfinished:
            alone, alone_failure = child(release, [entry], timeout)
            answers[entry] = alone.get(entry) or answers.get(entry) or {}
            answers[entry].setdefault("entry", entry)
            if not answers[entry].get("done"):
                answers[entry]["error"] = alone_failure or "no answer"
    return {e: dataclasses.replace(observe(release, answers.get(e), failure), environment=environment)
            for e in entries}


def install_releases(chosen: list[str], jobs: int) -> dict[str, str]:
    """Install what is missing; returns {release: reason} for those that could not be installed."""
    missing = [r for r in chosen if not release_env.is_installed(r)]
    failed: dict[str, str] = {}
    if not missing:
        return failed
    print(f"installing {len(missing)} release(s) into {release_env.INSTALL_ROOT}: {', '.join(missing)}",
          file=sys.stderr, flush=True)

    def install(release: str) -> None:
        try:
            release_env.install(release)
        except subprocess.CalledProcessError as exc:
            failed[release] = f"install failed (exit {exc.returncode})"

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(install, missing))
    return failed


Plan = dict  # {release: [entry, ...]}: what a run measures


def plan_for(entries: list[str], chosen: list[str], old: measured.SweepData | None = None) -> Plan:
    """Every entry on every release in ``chosen``; with ``old`` (``--resume``) only the rows it lacks,
    could not run, or measured with other entry code (:func:`fixes.measured.entry_code`)."""
    codes = {entry: measured.entry_code(entry) for entry in entries}
    plan: Plan = {}
    for release in chosen:
        todo = []
        for entry in entries:
            row = old.entry(entry).get(release) if old is not None else None
            if row is None or row.status == "could not run" or row.code != codes[entry]:
                todo.append(entry)
        if todo:
            plan[release] = todo
    return plan


def run_plan(plan: Plan, measure, jobs: int, on_release=None, desc: str = "sweep",  # noqa: ANN001
             progress: bool = True) -> dict[Pair, measured.Observation]:
    """``measure(release, entries) -> rows`` for each release of ``plan``, ``jobs`` releases at a time;
    ``on_release(rows)`` gets each release's rows as soon as they are in (the caller saves them).
    Ctrl-C (or any error) ends every child and re-raises: the releases finished before it have been
    handed to ``on_release``."""
    from tqdm import tqdm

    results: dict[Pair, measured.Observation] = {}
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        with tqdm(total=sum(map(len, plan.values())), desc=desc, unit="run", disable=not progress,
                  file=sys.stderr) as bar:
            futures = [pool.submit(measure, release, entries) for release, entries in plan.items()]
            for future in as_completed(futures):
                rows = future.result()
                results.update(rows)
                if on_release is not None:
                    on_release(rows)
                affected = sum(o.status == "affected" for o in rows.values())
                bar.set_postfix_str(f"{next(iter(rows)).release if rows else ''}: {affected}/{len(rows)} affected")
                bar.update(len(rows))
    except BaseException:
        stop_children()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    return results


def sweep(plan: Plan, jobs: int, timeout: float, on_release=None,  # noqa: ANN001 - a callback
          progress: bool = True, environment: str = measured.DEFAULT_ENVIRONMENT) -> dict[Pair, measured.Observation]:
    """Each release's entries of ``plan`` (:func:`run_release`), rows marked with the entry code."""
    codes = {entry: measured.entry_code(entry) for entries in plan.values() for entry in entries}

    def measure(release: str, entries: list[str]) -> dict[Pair, measured.Observation]:
        rows = (run_release(release, entries, timeout) if environment == measured.DEFAULT_ENVIRONMENT
                else run_release(release, entries, timeout, environment))
        return {Pair(entry, release): dataclasses.replace(observation, code=codes[entry])
                for entry, observation in rows.items()}

    return run_plan(plan, measure, jobs, on_release, "sweep", progress)


def _recorded_seconds(old: measured.SweepData, entry: str, release: str) -> float | None:
    row = old.entry(entry).get(release)
    return None if row is None else row.seconds


def shard_plan(plan: Plan, shard: shards.Shard, old: measured.SweepData) -> tuple[Plan, str]:
    """Part ``shard`` of ``plan`` and how the parts were balanced (:func:`ci.notebooks.shards.partition`): whole releases
    (each child imports DeepSpeed once) by the sum of their rows' recorded seconds in ``old``, when the plan has
    at least ``shard.count`` releases; otherwise (release, entry) pairs by each row's seconds, so every part has
    work. The part keeps the plan's order."""
    if len(plan) >= shard.count:
        def seconds(release: str) -> float | None:
            found = [_recorded_seconds(old, entry, release) for entry in plan[release]]
            return None if None in found else sum(found)  # type: ignore[arg-type]

        mine, method = shards.part(list(plan), seconds, shard)
        return {release: plan[release] for release in mine}, method
    pairs = [(release, entry) for release, entries in plan.items() for entry in entries]
    chosen, method = shards.part(pairs, lambda pair: _recorded_seconds(old, pair[1], pair[0]), shard)
    part: Plan = {}
    for release, entry in chosen:
        part.setdefault(release, []).append(entry)
    return part, method


def plan_digest(plan: Plan) -> str:
    """The name of a whole plan (its (entry, release) rows), the same on every machine that planned it."""
    return shards.digest([[entry, release] for release, entries in plan.items() for entry in entries])


class MergeError(RuntimeError):
    """Files that are not every finished part of one sharded sweep (the message says which and why)."""


def merge_parts(base: measured.SweepData, parts: list[tuple[Path, measured.SweepData]]) -> measured.SweepData:
    """``base`` with the rows of every finished part of one sharded sweep (``--shard``), and one ``last_run``:
    what the unsharded sweep writes over ``base`` (its start the parts' first, its wall time their longest, its
    runs their sum). Raises :class:`MergeError` (or :class:`ci.notebooks.shards.ShardError`) where a part is missing, given
    twice, unfinished, of another plan, or lacks a row it measured."""
    found: dict[int, tuple[Path, measured.SweepData, dict[str, object]]] = {}
    for path, data in parts:
        info = data.last_run.get("shard")
        if not isinstance(info, dict) or data.last_run.get("state") == "running":
            raise MergeError(f"{path} holds no finished part of a sharded sweep (its last_run names no shard): "
                             "made by `python -m ci.sweep --shard I/N`, run to its end")
        shard = shards.parse(str(info["part"]))
        if shard.index in found:
            raise MergeError(f"{found[shard.index][0]} and {path} are both part {shard}")
        found[shard.index] = (path, data, {**info, "count": shard.count})
    first_path, first, first_info = found[min(found)]
    same = ("kind", "environment", "entries", "releases")
    for index, (path, data, info) in sorted(found.items()):
        if info["count"] != first_info["count"] or info["plan"] != first_info["plan"] or \
                any(data.last_run.get(key) != first.last_run.get(key) for key in same):
            raise MergeError(f"{path} (part {info['part']}) is a part of another sweep than {first_path} "
                             f"(part {first_info['part']}): merge parts of one plan, cut from the same file")
    rows_of = {index: [tuple(row) for row in info["rows"]] for index, (_, _, info) in found.items()}  # type: ignore[union-attr]
    union = [row for rows in rows_of.values() for row in rows]
    shards.check_complete(rows_of, int(first_info["count"]), union, "ci.sweep --merge")  # type: ignore[arg-type]
    if shards.digest([list(row) for row in union]) != first_info["plan"]:
        raise MergeError("ci.sweep --merge: the parts' rows do not make up their plan (a part measured other rows "
                         "than it was given)")
    environment = str(first.last_run.get("environment", measured.DEFAULT_ENVIRONMENT))
    rows: dict[Pair, measured.Observation] = {}
    for index, (path, data, _) in sorted(found.items()):
        for entry, release in rows_of[index]:
            row = data.environment(environment).entry(entry).get(release)
            if row is None:
                raise MergeError(f"{path} (part {index}) has no row for {entry} on {release}, which it measured")
            rows[Pair(entry, release)] = row
    last_run = {key: value for key, value in first.last_run.items() if key != "shard"}
    last_run.update(at=min(str(d.last_run["at"]) for _, d, _ in found.values()),
                    wall_s=max(float(d.last_run["wall_s"]) for _, d, _ in found.values()),  # type: ignore[arg-type]
                    runs=sum(int(d.last_run["runs"]) for _, d, _ in found.values()))  # type: ignore[arg-type]
    full = all(bool(info.get("full")) for _, _, info in found.values())
    ran = first.environment(environment)  # the versions the parts measured with, not this interpreter's
    if environment == measured.DEFAULT_ENVIRONMENT:
        merged = merge(base, rows, list(last_run.get("releases") or []), last_run, full)  # type: ignore[arg-type]
        return dataclasses.replace(merged, torch=ran.torch, python=ran.python)
    _VERSIONS[environment] = (ran.torch, ran.python)
    return merge(base, rows, list(last_run.get("releases") or []), last_run, full, environment)  # type: ignore[arg-type]


class SweepBusyError(RuntimeError):
    """Another sweep holds the file."""


class Recorder:
    """The one writer of a sweep file during a run. It holds an exclusive lock next to the file (a
    second sweep on the same file refuses at once, naming the first), and merges each batch of rows
    into the file as it arrives, with an atomic write: an interrupt or a crash loses at most the
    releases still running."""

    def __init__(self, path: Path, environment: str = measured.DEFAULT_ENVIRONMENT) -> None:
        self.path = path
        self.environment = environment
        self.lock_path = path.with_name(f".{path.name}.lock")
        self._lock = None

    def __enter__(self) -> "Recorder":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.lock_path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise SweepBusyError(f"another sweep ({holder}) is writing {self.path}; wait for it to finish, "
                                 "or write elsewhere with --out") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}, started {datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}")
        handle.flush()
        self._lock = handle
        return self

    def __exit__(self, *_: object) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None

    def save(self, rows: dict[Pair, measured.Observation], chosen: list[str], last_run: dict[str, object],
             full: bool = False) -> None:
        measured.write(merge(measured.read(self.path), rows, chosen, last_run, full, self.environment), self.path)
        hold_after_save()


HOLD = "FIXBOOK_SWEEP_HOLD"  # a directory: after each save the sweep says so there and waits to be let go


def hold_after_save() -> None:
    """With ``FIXBOOK_SWEEP_HOLD=DIR`` set, a save writes ``DIR/saved-N`` (N counting from 1) and the sweep waits
    until ``DIR/go`` exists: a test that interrupts a sweep chooses the moment (after exactly N saves), instead of
    racing the sweep's speed. Unset, it returns at once."""
    hold = os.environ.get(HOLD)
    if not hold:
        return
    directory = Path(hold)
    (directory / f"saved-{len(list(directory.glob('saved-*'))) + 1}").touch()
    while not (directory / "go").exists():
        time.sleep(0.05)


def measure_coverage(old: measured.SweepData, entries: list[str], chosen: list[str] | None, jobs: int,
                     timeout: float, on_release=None,  # noqa: ANN001
                     environment: str = measured.DEFAULT_ENVIRONMENT) -> dict[Pair, measured.Observation]:
    """The fix coverage of every recorded ``affected`` row of ``entries`` (on ``chosen`` releases, or
    all): each release's entries in one child; the rows keep their measured status and gain ``fix``.
    ``old``: the rows of ``environment`` (:meth:`~fixes.measured.SweepData.environment`)."""
    todo: dict[str, list[str]] = {}
    for entry in entries:
        for release in old.entry(entry).affected:
            if chosen is None or release in chosen:
                todo.setdefault(release, []).append(entry)

    def one(release: str, entries: list[str]) -> dict[Pair, measured.Observation]:
        answers, failure = (run_child(release, entries, timeout * len(entries), coverage_only=True)
                            if environment == measured.DEFAULT_ENVIRONMENT else
                            run_child(release, entries, timeout * len(entries), True, environment))
        rows = {}
        for entry in entries:
            answer = answers.get(entry, {})
            fix = answer.get("fix") or "could not run"
            reason = str(answer.get("fix_reason") or failure or "no answer")[:300]
            rows[Pair(entry, release)] = dataclasses.replace(old.entry(entry).observations[release],
                                                             fix=fix, fix_reason=reason)  # type: ignore[arg-type]
        return rows

    return run_plan({release: todo[release] for release in sorted(todo, key=parse)}, one, jobs, on_release,
                    "coverage")


def merge(old: measured.SweepData, new: dict[Pair, measured.Observation], chosen: list[str],
          last_run: dict[str, object], full: bool = False,
          environment: str = measured.DEFAULT_ENVIRONMENT) -> measured.SweepData:
    """``old`` with the rows of ``new`` replaced; ``full``: this run covered every entry and release.
    Rows of another ``environment`` go to that environment's part of the file, nothing else changes."""
    if environment != measured.DEFAULT_ENVIRONMENT:
        part = merge(old.environment(environment), new, chosen, last_run, full, measured.DEFAULT_ENVIRONMENT)
        torch, python = environment_versions(environment)
        part = dataclasses.replace(part, torch=torch, python=python)
        return dataclasses.replace(old, environments={**old.environments, environment: part})
    results = {entry: dict(sweep.observations) for entry, sweep in old.results.items()}
    for pair, observation in new.items():
        results.setdefault(pair.entry, {})[pair.release] = observation
    # the installed torch's version from its metadata, not ``import torch``: a save must take milliseconds.
    # (Importing torch on the first save once took longer than two releases' runs under CI load, and a
    # Ctrl-C sent when the first row appeared found the next rows already saved.)
    return measured.SweepData(
        releases=sorted(set(old.releases) | set(chosen), key=parse),
        results={entry: measured.EntrySweep(entry, rows) for entry, rows in results.items()},
        torch=importlib.metadata.version("torch"), python=platform.python_version(), last_run=last_run,
        full_run=last_run if full else old.full_run, environments=old.environments)


_VERSIONS: dict[str, tuple[str, str]] = {}


def environment_versions(name: str) -> tuple[str, str]:
    """(torch, Python) versions of environment ``name``'s interpreter, asked once."""
    if name not in _VERSIONS:
        env = environments.get(name)
        done = subprocess.run([str(env.executable), "-c", "import platform, importlib.metadata as m; "
                               "print(m.version('torch'), platform.python_version())"],
                              capture_output=True, text=True)
        found = done.stdout.split() if done.returncode == 0 else [env.torch, env.python]
        _VERSIONS[name] = (found[0], found[1])
    return _VERSIONS[name]


def summary(data: measured.SweepData) -> str:
    """The recorded file in a few lines: its size, the latest runs, and the fix coverage (the README
    quotes these lines)."""
    rows = [o for sweep_ in data.results.values() for o in sweep_.observations.values()]
    affected = [o for o in rows if o.status == "affected"]
    fixed = sum(o.fix == "fixed" for o in affected)
    lines = [f"{len(data.results)} entries x {len(data.releases)} releases ({data.releases[0]} - {data.releases[-1]}): "
             f"{len(rows)} rows, " + ", ".join(f"{sum(o.status == s for o in rows)} {s}" for s in measured.STATUSES)]
    oldest = [entry for entry, sweep_ in sorted(data.results.items()) if sweep_.starts_at_oldest]
    lines.append(f"affected on the oldest release measured, {data.releases[0]}: {len(oldest)} entries (each range "
                 f"says 'since at least {data.releases[0]}')")
    if data.full_run:
        run = data.full_run
        lines.append(f"last full sweep: {run.get('at')}, {run.get('runs')} runs in {run.get('wall_s')} s, "
                     f"{run.get('jobs')} jobs")
    unmeasured = sum(o.fix is None for o in affected)
    lines.append(f"fix coverage: the fix fixes {fixed} of the {len(affected)} affected (entry, release) pairs; " +
                 ", ".join(f"{sum(o.fix == s for o in affected)} {s}" for s in measured.FIX_STATUSES[1:]) +
                 (f", {unmeasured} not measured" if unmeasured else ""))
    for name, part in sorted(data.environments.items()):
        rows = [o for sweep_ in part.results.values() for o in sweep_.observations.values()]
        lines.append(f"environment {name} (Python {part.python}, torch {part.torch}): {len(part.results)} entries, "
                     f"{len(rows)} rows, " + ", ".join(f"{sum(o.status == s for o in rows)} {s}"
                                                      for s in measured.STATUSES) +
                     f"; {sum(o.fix == 'fixed' for o in rows)} fixed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("--entry", action="append", help="entry id (repeatable; default: every entry)")
    parser.add_argument("--release", action="append", help=f"release (repeatable; default: PyPI ≥ {SINCE})")
    parser.add_argument("--jobs", type=int, default=2, help="runs in parallel (default 2)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per entry and release (default 300)")
    parser.add_argument("--out", type=Path, default=measured.DATA)
    parser.add_argument("--env", default=measured.DEFAULT_ENVIRONMENT, metavar="NAME",
                        help="run in this environment of ci/environments.toml (default: cpu, the project venv)")
    parser.add_argument("--summary", action="store_true", help="print what the recorded file says; run nothing")
    parser.add_argument("--resume", action="store_true",
                        help="measure only rows missing, could-not-run, or measured with other entry code")
    parser.add_argument("--coverage", action="store_true",
                        help="measure only the fix coverage of the rows recorded affected (no re-measuring the bug)")
    parser.add_argument("--shard", metavar="I/N",
                        help="measure only part I of N of the plan (cut from the file at --out, balanced by its "
                             "recorded seconds); its last_run names the part for --merge")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="FILE",
                        help="measure nothing: merge the files of every part of a sharded sweep (--shard) into --out")
    parser.add_argument("--child", nargs="+", metavar="ENTRY", help=argparse.SUPPRESS)
    parser.add_argument("--child-coverage", nargs="+", metavar="ENTRY", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args.child)
    if args.child_coverage:
        return child_main(args.child_coverage, coverage_only=True)
    # Ctrl-C (SIGINT) saves what finished and ends every child, however the sweep was started: a shell starts a
    # background job (`... &`, a CI step's) with SIGINT ignored, and Python then never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    import fixes

    if args.summary:
        print(summary(measured.read(args.out)))
        return 0
    if args.merge:
        if args.entry or args.release or args.resume or args.coverage or args.shard or \
                args.env != measured.DEFAULT_ENVIRONMENT:
            print("ci.sweep: --merge takes the parts' files (and --out) only: what they measured is in their "
                  "last_run", file=sys.stderr)
            return 2
        try:
            with Recorder(args.out):
                parts = [(path, measured.read(path)) for path in args.merge]
                merged = merge_parts(measured.read(args.out), parts)
                measured.write(merged, args.out)
        except (SweepBusyError, MergeError, shards.ShardError, fixes.SweepFileError, FileNotFoundError) as exc:
            print(f"ci.sweep: {exc}", file=sys.stderr)
            return 2
        print(f"merged {len(parts)} parts into {args.out}")
        print(summary(merged))
        return 0
    try:
        shard = shards.parse(args.shard) if args.shard else None
    except shards.ShardError as exc:
        print(f"ci.sweep: {exc}", file=sys.stderr)
        return 2
    if shard is not None and args.coverage:
        print("ci.sweep: --shard cuts a sweep's plan; --coverage measures the recorded affected rows in one run",
              file=sys.stderr)
        return 2
    entries = [fixes.get(e).id for e in args.entry] if args.entry else fixes.available()
    if args.env != measured.DEFAULT_ENVIRONMENT:
        try:
            _ENVIRONMENTS[args.env] = environments.require(args.env)
        except environments.EnvironmentError_ as exc:
            print(f"ci.sweep: {exc}", file=sys.stderr)
            return 2
    started = time.monotonic()
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        with Recorder(args.out, args.env) as recorder:
            old = measured.read(args.out).environment(args.env)
            if args.coverage:
                kind, chosen = "coverage", []
                releases = sorted(set(args.release), key=parse) if args.release else None
                running = {"at": stamp, "kind": kind, "state": "running", "entries": entries, "environment": args.env}
                results = measure_coverage(old, entries, releases, args.jobs, args.timeout,
                                           on_release=lambda rows: recorder.save(rows, [], running),
                                           environment=args.env)
            else:
                kind = "sweep"
                chosen = sorted(set(args.release), key=parse) if args.release else pypi_releases()
                whole = plan_for(entries, chosen, old if args.resume else None)
                if shard is not None:  # cut before installing: every part cuts the same plan, and installs its own
                    plan, method = shard_plan(whole, shard, old)
                    print(f"shard {shard}: {sum(map(len, plan.values()))} of the plan's {sum(map(len, whole.values()))} "
                          f"rows, on {len(plan)} release(s) (parts balanced by {method})", file=sys.stderr)
                    not_installed = install_releases(list(plan), args.jobs)
                else:
                    plan = whole
                    not_installed = install_releases(chosen, args.jobs)
                # the not installed releases' rows: every entry's (a part: those of its plan)
                lost = {release: (plan.get(release, []) if shard is not None else entries) for release in not_installed}
                plan = {release: todo for release, todo in plan.items() if release not in not_installed}
                running = {"at": stamp, "kind": kind, "state": "running", "entries": entries, "releases": chosen,
                           "environment": args.env}
                if args.resume:
                    print(f"--resume: {sum(map(len, plan.values()))} of {len(entries) * len(chosen)} rows to measure "
                          "(the others are in the file, measured with the same entry code)", file=sys.stderr)
                results = sweep(plan, args.jobs, args.timeout, on_release=lambda rows: recorder.save(rows, chosen, running),
                                environment=args.env)
                for release, reason in not_installed.items():
                    for entry in lost[release]:
                        results[Pair(entry, release)] = measured.Observation(release, "could not run", reason=reason,
                                                                             environment=args.env)
            wall = round(time.monotonic() - started, 1)
            last_run = {"at": stamp, "wall_s": wall, "runs": len(results), "jobs": args.jobs, "entries": entries,
                        "kind": kind, "releases": chosen or sorted({p.release for p in results}, key=parse),
                        "environment": args.env}
            full = kind == "sweep" and not args.entry and not args.release and not args.resume
            if shard is not None:  # a part alone is never the full sweep; the merge of all its parts may be
                last_run["shard"] = {"part": str(shard), "plan": plan_digest(whole), "balanced_by": method,
                                     "full": full, "rows": sorted([pair.entry, pair.release] for pair in results)}
                full = False
            recorder.save(results, chosen, last_run, full)
    except SweepBusyError as exc:
        print(f"ci.sweep: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ci.sweep: interrupted; every release finished before it is saved in {args.out}", file=sys.stderr)
        return 130
    report(results, wall, args.out, kind, args.env)
    return 0


def report(results: dict[Pair, measured.Observation], wall: float, out: Path, kind: str,
           environment: str = measured.DEFAULT_ENVIRONMENT) -> None:
    counts = {status: sum(o.status == status for o in results.values()) for status in measured.STATUSES}
    fix_counts = {status: sum(o.fix == status for o in results.values()) for status in measured.FIX_STATUSES}
    where = "" if environment == measured.DEFAULT_ENVIRONMENT else f" (environment {environment})"
    if kind == "sweep":
        print(f"{len(results)} runs{where} in {wall:.0f} s: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n) +
              f"; written to {out}")
    print(f"fix coverage of the {sum(o.fix is not None for o in results.values())} affected rows measured"
          f"{'' if kind == 'sweep' else f' in {wall:.0f} s'}: " +
          ", ".join(f"{n} {s}" for s, n in fix_counts.items() if n))
    for pair, observation in sorted(results.items(), key=lambda kv: (kv[0].entry, parse(kv[0].release))):
        if observation.status in ("could not run", "inconsistent"):
            print(f"  {pair.entry}@{pair.release}: {observation.status}: {observation.reason}")
        elif observation.fix not in (None, "fixed"):
            print(f"  {pair.entry}@{pair.release}: fix {observation.fix}: {observation.fix_reason}")
