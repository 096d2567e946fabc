"""Triage of the census backlog with upstream's own fix-PR tests: does each bug reproduce here, on CPU?

    python -m ci.triage --ds-clone PATH                   # every backlog row without a recorded outcome
    python -m ci.triage --ds-clone PATH --pr 7786 --force # one row again (add --release R for one release)
    python -m ci.triage --ds-clone PATH --entries         # each entry's cited PR test, without and with fixes.apply()
    python -m ci.triage --check                           # fails if a backlog row lacks an outcome, command or date
    python -m ci.triage --next                            # the ranked list of next entries
    python -m ci.triage --summary                         # counts per state and per component

For a census row the machine finds the fix commit in a DeepSpeed git clone (``--ds-clone``: a bare mirror will do;
CI needs none, it reads the record), the test files the commit added or changed and the test functions it
touched, and runs exactly those with pytest, as of the fix commit (its ``tests/`` tree), against the last release
before the fix and, where that fails, the first release with it, both from ``.deepspeed/`` and both of the release
sweep's set (the project's environment): a fix first released in the sweep's oldest release or before could not run,
and its reason names the release it would need. The census rows come from :data:`CENSUS`. Each run is a child
process with a timeout (its whole process group is killed), ``DS_ACCELERATOR=cpu`` and gloo, and the CPU edits of
``ci/triage/upstream_site/sitecustomize.py``: calls *from the test file* that only a GPU answers go to the CPU, each edit
that fires is recorded; no assertion is ever touched. Outcomes (:data:`STATES`):

* ``reproduced by upstream's test`` — fails before the fix, passes with it: a candidate entry;
* ``not detected on CPU`` — passes before the fix as well;
* ``needs an accelerator`` — skips, or fails for want of CUDA/NCCL, on CPU;
* ``no upstream test`` — the commit ships none (the row says what a scripted attempt would need);
* ``could not run`` — with the error (a timeout, a crash, a test that fails with the fix too): a later run may retry.

A ``no upstream test`` row is then decided by measurement with the differential sweep's grid (``python -m
ci.triage.grid``, :mod:`.grid`): ``reproduced by the differential sweep`` (a cell that runs the changed code differs
before the fix and agrees after it: a candidate entry, ranked with the others) or ``not detected by the grid`` (with
the cells that ran it); the outcome keeps the grid's evidence under ``grid``.

``--entries`` runs an entry's cited PR tests on its last affected release without and with ``fixes.apply()``, with
the pytest DeepSpeed's tests pin (:func:`choose_pytest`); each process the test starts records the fixes it holds,
and the run with the fix counts only where every one held it (:func:`fix_proof`); errors and skips are no results
(:func:`entry_verdict`).

Every run is kept in ``ci/data/triage.json`` with its tests, releases, counts, edits, duration, date and the command
that repeats it; a run with the same tests and release is not repeated unless ``--force``.

Package ``ci.triage``: the upstream census and its triage. The triage (here), the census merged into
``fixes/data/upstream_fixes.json`` (``census.py``: ``python -m ci.triage.census``) and ``upstream_site/``, the
``sitecustomize`` and pytest plugin put on the ``PYTHONPATH`` of every upstream test run (files, not modules of
this package).
May import: ``ci.sweep``, ``ci.notebooks``, ``ci.releases``, ``ci.processes`` and ``fixes``; ``grid.py`` also
``ci.differential``.
"""
from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable

from .. import ROOT

DATA = ROOT / "ci" / "data" / "triage.json"
# Upstream test cases of a cited PR that assert another change of that PR, one no entry claims to fix, with why
SCOPE = ROOT / "ci" / "data" / "upstream_test_scope.toml"
# The census, one TSV per span of first releases (the same columns; no commit in two): every DeepSpeed bug-fix
# commit first released after 0.14.0.
# Rows of the backlog decided by hand (a duplicate of an entry, say): ci.triage.census merges them; --next skips them
CENSUS_TRIAGE = ROOT / "ci" / "data" / "census_triage.toml"
CENSUS = (ROOT / "ci" / "data" / "census-0.14-0.15.tsv",  # first released in 0.14.1 – 0.16.0
          ROOT / "ci" / "data" / "census.tsv")  # 0.16.1 and later
SITE = ROOT / "ci" / "triage" / "upstream_site"  # its sitecustomize: the CPU edits and fixes.apply() in every child Python
CACHE = ROOT / ".cache" / "triage"  # the tests/ trees of the fix commits, extracted once each

REPRODUCED = "reproduced by upstream's test"
NOT_DETECTED = "not detected on CPU"
ACCELERATOR = "needs an accelerator"
NO_TEST = "no upstream test"
COULD_NOT_RUN = "could not run"
# A row whose fix ships no test, decided by the differential sweep's grid (``python -m ci.triage.grid``)
GRID_REPRODUCED = "reproduced by the differential sweep"
GRID_NOT_DETECTED = "not detected by the grid"
STATES = (REPRODUCED, GRID_REPRODUCED, NOT_DETECTED, GRID_NOT_DETECTED, ACCELERATOR, NO_TEST, COULD_NOT_RUN)

TIMEOUT_S = 600.0  # one (row, release) run
HANG_S = 240  # upstream's own per-test hang limit (DS_UNITTEST_TIMEOUT): a case still running then has hung
# The CPU accelerator counts its devices from LOCAL_SIZE (else NUMA nodes: 1 here), and upstream's launcher skips a
# test that asks for more ranks than devices. Set in the pytest process only (each rank sets its own).
DEVICES = 8
ENVIRONMENT_EDITS = (f"LOCAL_SIZE={DEVICES} in the pytest process (the CPU accelerator then counts {DEVICES} devices, "
                     "so upstream's launcher starts a test's ranks instead of skipping it)",)
# Words in a skip reason or failure that say the test needs a GPU (or a GPU-only library) to run at all.
ACCELERATOR_WORDS = re.compile(r"cuda|gpu|nccl|accelerator|triton|not compiled with|fp16 (?:is )?not supported|"
                               r"bf16 (?:is )?not supported|half precision|hpu|xpu|npu|device_count|nvcc|cupy|"
                               r"apex|flash.?attn|requires_cuda|not supported on cpu|cpu accelerator does not",
                               re.IGNORECASE)


class TriageError(RuntimeError):
    """The triage cannot go on (no clone, an unknown row or release); the message says what is missing."""


# ---- the census rows ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    pr: int | None
    sha: str
    first_release: str | None  # None: no release in the census snapshot had it yet
    component: str
    symptom: str
    subject: str
    backlog: bool  # user-visible and likely reproducible on CPU
    note: str = ""  # the census's one-line description of the fault

    @property
    def key(self) -> str:
        return str(self.pr) if self.pr else self.sha


def census_records(paths: Iterable[Path] = CENSUS) -> list[dict[str, str]]:
    """The census files' rows as read (column: text, and ``source``: the file's name), file after file. A commit (or
    PR) in two rows is an error naming both places: one fix counted twice would skew every count and the triage."""
    records: list[dict[str, str]] = []
    seen: dict[str, str] = {}
    for path in paths:
        with Path(path).open() as handle:
            for number, record in enumerate(csv.DictReader(handle, delimiter="\t"), 2):
                for key in filter(None, (record["sha"], record["pr"] and f"#{record['pr']}")):
                    if key in seen:
                        raise TriageError(f"census row {key} is in {seen[key]} and again in {Path(path).name} "
                                          f"line {number}: each fix is one row")
                    seen[key] = f"{Path(path).name} line {number}"
                records.append({**record, "source": Path(path).name})
    return records


def census_rows(paths: Iterable[Path] = CENSUS) -> list[Row]:
    rows = []
    for row in census_records(paths):
        first = row["first_release"]
        rows.append(Row(int(row["pr"]) if row["pr"] else None, row["sha"],
                        first[1:] if first.startswith("v") else None, row["component"], row["symptom"],
                        row["subject"], row["user_visible"] == "yes" and row["cpu_reproducible"] == "likely",
                        row["note"]))
    return rows


def backlog(paths: Iterable[Path] = CENSUS) -> list[Row]:
    return [row for row in census_rows(paths) if row.backlog]


# What upstream's tests import that the project's environment lacks (transformers, ...): installed apart, once
TEST_PACKAGES = ROOT / "ci" / "data" / "triage-requirements.txt"


def install_test_packages(requirements: Path = TEST_PACKAGES, cache: Path = CACHE, python: str = sys.executable) -> Path:
    """The packages of ``requirements`` installed apart (``pip --target``, ``--no-deps``: the project's own packages
    are never shadowed) under ``cache``, once per content of the file; returns the folder for the runs' path."""
    import hashlib

    text = requirements.read_text()
    target = cache / f"packages-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
    if (target / ".complete").exists():
        return target
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
                           "--target", str(target), "-r", str(requirements)], capture_output=True, text=True)
    if done.returncode != 0:
        raise TriageError(f"the upstream tests' packages ({requirements.name}) could not be installed: "
                          f"{_tail(done.stderr or done.stdout)}")
    (target / ".complete").write_text(text)
    return target


def packages_edit(requirements: Path = TEST_PACKAGES) -> str:
    """The line each run records for :func:`install_test_packages`."""
    wanted = [line.strip() for line in requirements.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return f"installed apart for upstream's test imports (ci/data/{requirements.name}, --no-deps): {', '.join(wanted)}"


# ---- the clone: the fix commit, its tests ------------------------------------------------------------------

class Clone:
    """A DeepSpeed git repository (bare or not), read with git only."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        if self._git("rev-parse", "--git-dir", check=False).returncode != 0:
            raise TriageError(f"{self.path} is not a git repository (--ds-clone: a clone of DeepSpeed, e.g. a bare "
                              "mirror of github.com/deepspeedai/DeepSpeed)")

    def _git(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(self.path), *args], capture_output=True, text=True, check=check)

    def commit(self, row: Row) -> str:
        """The fix commit's full hash: the census's abbreviated one, or the commit whose subject names the PR."""
        found = self._git("rev-parse", "--verify", "--quiet", f"{row.sha}^{{commit}}", check=False)
        if found.returncode == 0:
            return found.stdout.strip()
        if row.pr:
            logged = self._git("log", "--all", "--format=%H", "--fixed-strings", f"--grep=(#{row.pr})").stdout.split()
            if logged:
                return logged[-1]
        commit = f" ({row.sha})" if row.sha else ""
        raise TriageError(f"the fix commit of PR #{row.pr or row.key}{commit} is not in the DeepSpeed clone given "
                          f"(--ds-clone; its newest commit: {self.newest()})")

    def newest(self) -> str:
        """The clone's newest commit as a reader can place it, without the clone's path (which is this machine's
        and would reach the site through a recorded reason): its date and subject."""
        done = self._git("log", "-1", "--format=%cs %s", check=False)
        when, _, subject = done.stdout.strip().partition(" ")
        return f"{when}, {subject[:80]}" if when else "none read"

    def release_before(self, release: str) -> str | None:
        """The newest release tag (``vX.Y.Z``) of the clone older than ``release``; None where it has none."""
        from fixes.versions import parse

        tags = self._git("tag", "--list", "v*", check=False).stdout.split()
        older = [tag[1:] for tag in tags if re.fullmatch(r"v\d+\.\d+\.\d+", tag) and parse(tag[1:]) < parse(release)]
        return max(older, key=parse) if older else None

    def changed_tests(self, commit: str) -> dict[str, set[int] | None]:
        """Test files (``tests/**/test_*.py``) the commit added or changed: the lines it added or changed in each,
        numbered as in the commit's version; ``None`` for a file it added whole. Deleted files are left out."""
        diff = self._git("show", "--format=", "--unified=0", "--no-renames", commit, "--", "tests").stdout
        changed: dict[str, set[int] | None] = {}
        path = None
        for line in diff.splitlines():
            if line.startswith("+++ "):
                target = line[4:]
                path = target[2:] if target.startswith("b/") else None
                if path and not re.search(r"(^|/)test_[^/]*\.py$", path):
                    path = None
                if path:
                    changed.setdefault(path, set())
            elif line.startswith("--- /dev/null") :
                continue
            elif path and line.startswith("@@"):
                match = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
                if match:
                    old_start, old_count = int(match[1]), int(match[2] or 1)
                    start, count = int(match[3]), int(match[4] or 1)
                    lines = changed[path]
                    if lines is not None:
                        if old_start == 0 and old_count == 0 and count > 0 and self._is_new(commit, path):
                            changed[path] = None
                        else:
                            lines.update(range(start, start + max(count, 1)))
        return changed

    def _is_new(self, commit: str, path: str) -> bool:
        return self._git("cat-file", "-e", f"{commit}^:{path}", check=False).returncode != 0

    def show(self, commit: str, path: str, missing_ok: bool = False) -> str:
        """The file at ``path`` as of ``commit`` (with ``missing_ok``, "" where it has none)."""
        return self._git("show", f"{commit}:{path}", check=not missing_ok).stdout

    def extract_tests(self, commit: str, dest: Path) -> Path:
        """The commit's ``tests/`` tree under ``dest`` (once); returns ``dest/tests``. Nothing else of the
        repository comes along: ``import deepspeed`` finds the release under test, never the clone's source."""
        tests = dest / "tests"
        if (dest / ".complete").exists():
            return tests
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(self.path), "archive", "--format=tar", commit, "tests"],
                                 capture_output=True, check=True).stdout
        with tempfile.TemporaryFile() as handle:
            handle.write(archive)
            handle.seek(0)
            with tarfile.open(fileobj=handle) as tar:
                tar.extractall(dest, filter="data")
        (dest / ".complete").write_text(commit)
        return tests

    def source_diff(self, commit: str) -> str:
        """The commit's diff of ``deepspeed/``, with no context lines and no rename detection."""
        return self._git("show", "--format=", "--unified=0", "--no-renames", commit, "--", "deepspeed").stdout

    def added_source_lines(self, commit: str) -> dict[str, list[str]]:
        """Per ``deepspeed/**.py`` file the commit changed, the code lines it added (stripped, no blank or comment
        lines): what a release containing the fix has."""
        diff = self.source_diff(commit)
        added: dict[str, list[str]] = {}
        path = None
        for line in diff.splitlines():
            if line.startswith("+++ "):
                path = line[6:] if line.startswith("+++ b/") and line.endswith(".py") else None
            elif path and line.startswith("+") and not line.startswith("+++"):
                code = line[1:].strip()
                if code and not code.startswith("#"):
                    added.setdefault(path, []).append(code)
        return added


def select_tests(source: str, path: str, changed: set[int] | None) -> tuple[list[str], str]:
    """The node ids (relative to ``tests/``) of the test functions in ``source`` that the commit touched, and how
    they were chosen: every test of a file added whole; else each test function, or each test of a class, whose
    lines the commit changed; else (only helpers changed) every test of the file."""
    relative = path.removeprefix("tests/")
    tree = ast.parse(source)
    tests: list[tuple[str, int, int, str | None]] = []  # node id, first line, last line, class
    class_spans: dict[str, tuple[int, int]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            tests.append((f"{relative}::{node.name}", _first_line(node), node.end_lineno or node.lineno, None))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            class_spans[node.name] = (_first_line(node), node.end_lineno or node.lineno)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    tests.append((f"{relative}::{node.name}::{item.name}", _first_line(item),
                                  item.end_lineno or item.lineno, node.name))
    every = [test[0] for test in tests]
    if changed is None:
        return every, f"{relative}: added by the commit, every test"
    touched = [test for test in tests if any(test[1] <= line <= test[2] for line in changed)]
    in_class_only = {name for name, (first, last) in class_spans.items()
                     if any(first <= line <= last for line in changed)
                     and not any(t[3] == name and any(t[1] <= line <= t[2] for line in changed) for t in tests)}
    chosen = [t[0] for t in tests if t in touched or t[3] in in_class_only]
    if chosen:
        return chosen, f"{relative}: the test functions whose lines the commit changed"
    return every, f"{relative}: the commit changed helpers only, every test of the file"


def _first_line(node: ast.AST) -> int:
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno, *(d.lineno for d in decorators)])  # type: ignore[attr-defined]


def contains_fix(added: dict[str, list[str]], release_dir: Path, threshold: float = 0.8) -> bool | None:
    """Whether the release in ``release_dir`` has the fix: at least ``threshold`` of the code lines the commit added
    are in the release's files. ``None`` where the commit added no code line."""
    wanted = found = 0
    for path, lines in added.items():
        target = release_dir / path
        present = {line.strip() for line in target.read_text(errors="replace").splitlines()} if target.exists() else set()
        wanted += len(lines)
        found += sum(line in present for line in lines)
    return None if not wanted else found / wanted >= threshold


# ---- one run: the selected tests against one release --------------------------------------------------------

@dataclass
class TestResult:
    node: str  # the selected test function
    outcome: str  # passed | failed | skipped | error
    message: str = ""
    case: str = ""  # the test case: the node with its parameters, e.g. ``...::test_x[0-False]``

    def __post_init__(self) -> None:
        self.case = self.case or self.node


@dataclass
class ReleaseRun:
    """The selected tests on one release, in one child process."""

    release: str
    tests: list[str]
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    errors: int = 0
    failures: dict[str, str] = field(default_factory=dict)  # test case -> its first failure line
    skips: list[str] = field(default_factory=list)  # the distinct skip reasons
    failing: list[str] = field(default_factory=list)  # the test cases that failed or errored
    passing: list[str] = field(default_factory=list)  # the test cases that passed
    edits: list[str] = field(default_factory=list)
    applied: str = ""  # the entry whose fix the run applied (fixes.apply), "" for none
    fix_log: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    stacks: list[str] = field(default_factory=list)  # a hung run: where each process was waiting (hang_stacks)
    date: str = ""
    command: str = ""
    timed_out: bool = False
    crashed: str = ""  # the child's exit without a test report: exit status and its output's tail
    # With ``applied``: each process's record of the fixes it held, the pytest process (rank "pytest") and every rank
    # that joined a process group: {"pid", "rank", "world_size", "applied": [ids], "missing": [ids]}
    processes: list[dict[str, Any]] = field(default_factory=list)
    pytest: str = ""  # the pytest that ran the tests, and why that one (the pin of DeepSpeed's own tests)

    @property
    def ran(self) -> bool:
        return bool(self.passing or self.failing)

    @property
    def tests_ran(self) -> bool:
        """Whether any test case reached a result (passed or failed): errors (collection, setup) and skips are not
        results, and a run with nothing else could not run."""
        return bool(self.passed or self.failed)

    @property
    def accelerator_only(self) -> bool:
        """Every test skipped or failed, and every reason says it needs a GPU."""
        reasons = list(self.skips) + list(self.failures.values())
        return not self.passing and bool(reasons) and all(ACCELERATOR_WORDS.search(r) for r in reasons)

    def brief(self) -> str:
        text = f"{self.release}: {self.passed} passed, {self.failed} failed, {self.skipped} skipped, {self.errors} errors"
        if self.timed_out:
            text += " (timed out)"
        if self.crashed:
            text += f" (crashed: {self.crashed[:120]})"
        return text


def pytest_ini(tests_dir: Path) -> Path:
    """Upstream's ``pytest.ini`` without its ``addopts`` (whose marker filter would deselect a chosen test): the
    markers stay declared. Written beside the tests."""
    source = tests_dir / "pytest.ini"
    lines = source.read_text().splitlines() if source.exists() else ["[pytest]"]
    kept, skipping = [], False
    for line in lines:
        if re.match(r"\s*addopts\s*=", line):
            skipping = True
            continue
        if skipping and (line.startswith((" ", "\t")) and line.strip()):
            continue
        skipping = False
        kept.append(line)
    ini, text = tests_dir / "fixbook-triage.ini", "\n".join(kept) + "\n"
    if not ini.exists() or ini.read_text() != text:  # two runs side by side: never rewrite what one may be reading
        ini.write_text(text)
    return ini


# ---- the pytest DeepSpeed's own tests pin ------------------------------------------------------------------------

# pytest releases a triage may install apart when DeepSpeed's pin excludes this Python's (newest first): the last of
# each line. DeepSpeed pins ``pytest<8.4`` for its DistributedFixture classes, which newer pytest no longer finds.
PYTEST_CANDIDATES = ("8.3.5", "7.4.4")
# How DeepSpeed's tests/unit/common.py made a DistributedFixture class a fixture until upstream pinned pytest<8.4:
# pytest 8.4 reads fixtures another way, and a test that takes one fails with "fixture '...' not found"
OLD_FIXTURE_MARKER = "_pytestfixturefunction"


@dataclass(frozen=True)
class PytestChoice:
    """The pytest a run uses: ``version``, the pin it satisfies, and ``path`` (a directory to put first on the path,
    holding that pytest installed apart) or ``None`` for this Python's own."""

    version: str
    pin: str
    path: Path | None = None

    def describe(self) -> str:
        where = "installed apart for triage runs" if self.path else "this Python's"
        return f"{self.version} ({where}; DeepSpeed's tests pin {self.pin or 'no version'})"


def _pytest_version() -> str:
    from importlib.metadata import version

    return version("pytest")


def pytest_pin(requirements: str) -> str:
    """The version specifier of ``pytest`` in a requirements file's text (``requirements/requirements-dev.txt``):
    ``">=7.2.0,<8.4.0"``, or ``""`` where it names pytest without one (or not at all)."""
    for line in requirements.splitlines():
        match = re.match(r"\s*pytest\s*((?:[<>=!~]=?\s*[\w.*]+\s*,?\s*)*)(?:;.*)?(?:#.*)?$", line.split("#")[0])
        if match:
            return re.sub(r"\s+", "", match[1]).rstrip(",")
    return ""


def choose_pytest(pin: str, current: str, candidates: Iterable[str] = PYTEST_CANDIDATES) -> str | None:
    """The pytest version to run DeepSpeed's tests with: ``None`` where this Python's (``current``) satisfies
    ``pin``, else the first of ``candidates`` that does. Raises TriageError where none does."""
    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(pin)
    if current in spec:
        return None
    for candidate in candidates:
        if candidate in spec:
            return candidate
    raise TriageError(f"DeepSpeed's tests pin pytest{pin}; neither this Python's {current} nor any of "
                      f"{', '.join(candidates)} satisfies it (ci.triage PYTEST_CANDIDATES)")


def install_pytest(version: str, cache: Path = CACHE, python: str = sys.executable) -> Path:
    """``pytest==version`` (with its own dependencies) in a directory of its own under ``cache``, installed once;
    nothing in this Python's environment changes. Returns the directory."""
    target = cache / f"pytest-{version}"
    if (target / ".complete").exists():
        return target
    done = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--target",
                           str(target), f"pytest=={version}"], capture_output=True, text=True)
    if done.returncode != 0:
        raise TriageError(f"pytest {version} could not be installed apart: {_tail(done.stderr or done.stdout)}")
    (target / ".complete").write_text(version)
    return target


# The ops upstream's distributed tests build on CPU on first use (deepspeed.comm's shared-memory collectives, FusedAdam): built
# once per release before a run, without the hang limit, so that a slow build is not taken for a hung test.
WARM_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")


def build_ops(release: str, release_dir: Path, python: str = sys.executable, timeout: float = TIMEOUT_S) -> str:
    """Build :data:`WARM_OPS` for ``release`` into its torch-extensions cache (a no-op once built). Returns "" or
    why a build failed (the run then goes on: a test that needs the op says so). A build past ``timeout`` is killed
    with its whole process group (the compiler included) and the lock it held removed, so no later build waits on
    a dead one."""
    extensions = ROOT / ".cache" / "torch_extensions" / release
    env = {**os.environ, "PYTHONPATH": str(release_dir), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "TORCH_EXTENSIONS_DIR": str(extensions)}
    code = ("from deepspeed.accelerator import get_accelerator\n"
            f"for name in {WARM_OPS!r}:\n    get_accelerator().create_op_builder(name).load()\n")
    started = time.time()
    child = subprocess.Popen([python, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True)
    try:
        _, errors = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(child)
        child.communicate()
        remove_locks_since(extensions, started)
        return f"building {', '.join(WARM_OPS)} took over {timeout:.0f} s"
    return "" if child.returncode == 0 else f"building {', '.join(WARM_OPS)} failed: {_tail(errors)}"


def remove_locks_since(extensions: Path, since: float) -> None:
    """Remove the build locks under ``extensions`` made at or after ``since`` (a killed run's own: its builds died
    with it)."""
    for lock in extensions.glob("*/lock") if extensions.is_dir() else []:
        try:
            if lock.stat().st_mtime >= since:
                lock.unlink()
        except FileNotFoundError:
            pass


STALE_LOCK_S = 1200  # no op build here takes this long: an older torch-extension lock is a killed build's leftover


def clear_stale_build_locks(extensions: Path, older_than: float = STALE_LOCK_S) -> list[Path]:
    """Remove the ``lock`` files of torch extension builds under ``extensions`` older than ``older_than`` seconds: a
    build killed mid-way (a run's timeout) leaves its lock, and every later build of that op waits on it forever,
    which a test then reports as a hang. Returns what it removed."""
    removed = []
    for lock in extensions.glob("*/lock") if extensions.is_dir() else []:
        try:
            if time.time() - lock.stat().st_mtime > older_than:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:
            pass
    return removed


def run_tests(tests_dir: Path, tests: list[str], release: str, release_dir: Path, *, timeout: float = TIMEOUT_S,
              apply: str = "", command: str = "", python: str = sys.executable, hang: float = HANG_S,
              pytest: PytestChoice | None = None) -> ReleaseRun:
    """``tests`` (node ids under ``tests_dir``) with pytest in a child process that sees DeepSpeed ``release`` from
    ``release_dir``, on CPU, with the CPU edits (and ``fixes.apply(apply)`` in every process where given, each
    process's record of what it held kept in ``processes``). ``pytest``: a pytest installed apart (its directory goes
    first on the path), else the running Python's. A child still running after ``timeout`` seconds is killed with its
    whole process group."""
    tests_dir = tests_dir.resolve()  # pytest 8.3 names no module of a rootdir reached through a symlink
    run = ReleaseRun(release, list(tests), applied=apply, command=command,
                     date=datetime.now(timezone.utc).strftime("%Y-%m-%d"),
                     pytest=pytest.describe() if pytest else f"{_pytest_version()} (this Python's)")
    clear_stale_build_locks(ROOT / ".cache" / "torch_extensions" / release)
    work = Path(tempfile.mkdtemp(prefix="fixbook-triage-"))
    report, log, processes = work / "report.jsonl", work / "edits.log", work / "processes.jsonl"
    stacks = work / "stacks"
    stacks.mkdir()
    log.touch()
    path = [str(SITE)] + ([str(pytest.path)] if pytest and pytest.path else []) + [str(release_dir)] + (
        [str(ROOT)] if apply else []) + [str(install_test_packages())]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
           "FIXBOOK_TRIAGE_EDITS": "1", "FIXBOOK_TRIAGE_TESTS": str(tests_dir), "FIXBOOK_TRIAGE_LOG": str(log),
           "DS_UNITTEST_TIMEOUT": str(int(min(hang, max(30, timeout - 30)))), "DS_DISABLE_REUSE_DIST_ENV": "1",
           "TORCH_EXTENSIONS_DIR": str(ROOT / ".cache" / "torch_extensions" / release),
           "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "LOCAL_SIZE": str(DEVICES), "FIXBOOK_TRIAGE_REPORT": str(report), "FIXBOOK_TRIAGE_HANG_S": str(hang),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",  # nothing is downloaded: a test that needs it says so
           "FIXBOOK_TRIAGE_PROCESSES": str(processes), "FIXBOOK_TRIAGE_STACKS": str(stacks),
           "FIXBOOK_TRIAGE_STACK_S": str(max(10, int(hang // 4)))}
    env.pop("FIXBOOK_TRIAGE_APPLY", None)
    if apply:
        env["FIXBOOK_TRIAGE_APPLY"] = apply
    argv = [python, "-m", "pytest", "-c", str(pytest_ini(tests_dir)), "--rootdir", str(tests_dir), "-p",
            "no:cacheprovider", "-p", "no:randomly", "-p", "fixbook_triage_report", "-q", "-rs", "--color=no", *tests]
    started, wall_started = time.monotonic(), time.time()
    chosen = list(tests)
    while True:
        child = subprocess.Popen([*argv[:-len(tests)], *chosen], cwd=tests_dir, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        try:
            output, _ = child.communicate(timeout=max(1.0, timeout - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            _kill_group(child)
            output, _ = child.communicate()
            run.timed_out = True
        text = output.decode(errors="replace")
        # pytest refuses the whole run (exit 4) when a given test cannot be collected on this release: run the rest
        missing = [t for t in chosen if f"found no collectors for {tests_dir / t.split('::')[0]}::{t.split('::', 1)[1]}" in text]
        if child.returncode != 4 or not missing or len(missing) == len(chosen) or run.timed_out:
            break
        run.skips.append(f"not collected on {release}: {', '.join(t.split('::', 1)[1] for t in missing)}")
        chosen = [t for t in chosen if t not in missing]
    run.duration_s = round(time.monotonic() - started, 1)
    if run.timed_out or child.returncode == -signal.SIGKILL:  # its builds died with it: their locks would stall the next
        remove_locks_since(ROOT / ".cache" / "torch_extensions" / release, wall_started)
    results = read_report(report, tests, hung="Test hanged, exiting" in text)
    for result in results:
        setattr(run, {"passed": "passed", "failed": "failed", "skipped": "skipped", "error": "errors"}[result.outcome],
                getattr(run, {"passed": "passed", "failed": "failed", "skipped": "skipped",
                              "error": "errors"}[result.outcome]) + 1)
        if result.outcome in ("failed", "error"):
            run.failures.setdefault(result.case, result.message)
        elif result.outcome == "skipped" and result.message not in run.skips:
            run.skips.append(result.message)
    outcomes: dict[str, set[str]] = {}
    for result in results:
        outcomes.setdefault(result.case, set()).add(result.outcome)
    run.failing = [case for case, seen in outcomes.items() if seen & {"failed", "error"}]
    run.passing = [case for case, seen in outcomes.items() if seen == {"passed"}]
    if "Test hanged, exiting" in text:
        run.timed_out = True
    if not results and not run.timed_out:
        module_skips = skipped_modules(text) if "found no collectors" in text else []
        for count, reason in module_skips:  # a test module that skips itself whole (pytest.skip(allow_module_level))
            run.skipped += count
            if reason not in run.skips:
                run.skips.append(reason)
        if not module_skips:
            run.crashed = f"exit {child.returncode}: {_tail(text)}"
    elif child.returncode not in (0, 1) and not run.timed_out and not run.ran:
        run.crashed = f"exit {child.returncode}: {_tail(text)}"
    lines = dict.fromkeys(line.strip() for line in log.read_text().splitlines() if line.strip())
    run.edits = list(ENVIRONMENT_EDITS) + [packages_edit()] + sorted(line.removeprefix("edit: ") for line in lines if line.startswith("edit: "))
    run.fix_log = [line for line in lines if not line.startswith("edit: ")]
    run.processes = read_processes(processes)
    if run.timed_out or any(message == HUNG for message in run.failures.values()):
        run.stacks = [portable(line) for line in hang_stacks(stacks)]
    for leftover in (report, log, processes, *stacks.glob("*.txt*")):
        leftover.unlink(missing_ok=True)
    stacks.rmdir()
    work.rmdir()
    return run


_COLOUR = re.compile(r"\x1b?\[[0-9;]*m")
_SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] [^\s:]+:\d+: (.+?)\s*$", re.MULTILINE)


def skipped_modules(output: str) -> list[tuple[int, str]]:
    """(count, reason) of each ``SKIPPED`` line of pytest's short summary in ``output``: where nothing was collected,
    a module that skipped itself at import (``pytest.skip(..., allow_module_level=True)``), with its reason."""
    return [(int(count), reason) for count, reason in _SKIPPED.findall(_COLOUR.sub("", output))]


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_WAITING_IN = ("deepspeed/", "torch/distributed/", "multiprocessing/", "tests/unit/")  # as _short writes them


def _frame(line: str) -> str:
    found = _FRAME.match(line)
    return f"{_short(found[1])}:{found[2]} in {found[3]}" if found else ""


def _short(path: str) -> str:
    """A frame's file without this machine's prefix: from ``deepspeed/``, ``torch/``, ``tests/`` or the standard
    library's own folder on."""
    for marker in ("/deepspeed/", "/torch/", "/tests/", "/multiprocessing/", "/concurrent/"):
        at = path.rfind(marker)
        if at >= 0:
            return path[at + 1:]
    return path.rsplit("/", 1)[-1]


def waiting_point(stacks: list[str]) -> str:
    """The telling line of a hung run's stacks: a process that died, else the first place in DeepSpeed or torch
    (the ranks), else the first line; "" for none."""
    return next((line for line in stacks if line.startswith(("a process died", "deepspeed/", "torch/"))),
                stacks[0] if stacks else "")


def hang_stacks(folder: Path, limit: int = 8) -> list[str]:
    """Where each process of a hung run was waiting: from the last stack dump each wrote (faulthandler, in
    ``folder``), per thread the innermost frame in DeepSpeed, torch.distributed, multiprocessing or the test, with
    the frame that called it; one line per place, each once, at most ``limit``. A process that died of a fatal
    signal says so first; the processes that wrote nothing (ended before the first dump) are counted last."""
    lines: list[str] = []
    silent = 0
    for pid in sorted({path.name.split(".txt")[0] for path in folder.glob("*.txt*")}):
        text = "".join(path.read_text(errors="replace") for path in (folder / f"{pid}.txt", folder / f"{pid}.txt.fatal")
                       if path.exists())
        fatal = re.search(r"Fatal Python error: ([^\n]+)", text)
        if fatal:
            lines.insert(0, f"a process died: {fatal[1].strip()}")
        dumps = text.split("Timeout (")
        if len(dumps) < 2:
            silent += not fatal
            continue
        for thread in dumps[-1].split("Thread 0x")[1:]:
            frames = [f for f in map(_frame, thread.splitlines()[1:]) if f]
            inner = next((i for i, f in enumerate(frames) if f.startswith(_WAITING_IN)), None)
            if inner is None:
                continue
            line = f"{frames[inner]}" + (f" <- {frames[inner + 1]}" if inner + 1 < len(frames) else "")
            if line not in lines:
                lines.append(line)
    lines = lines[:limit]
    if silent:
        lines.append(f"{silent} processes wrote no stack: they ended before the first dump")
    return lines


def read_processes(path: Path) -> list[dict[str, Any]]:
    """The per-process lines ``ci/triage/upstream_site`` wrote (a line cut short by a kill is left out)."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return found


def scope(pr: int | None, path: Path | None = None) -> tuple[set[str], str]:
    """The test cases of ``pr``'s upstream test that the entries' runs leave out, and why (``SCOPE``): cases that
    assert another change the PR made, one no entry claims to fix. Nothing for a PR the file does not name."""
    import tomllib

    path = path or SCOPE
    if pr is None or not path.exists():
        return set(), ""
    found = tomllib.loads(path.read_text()).get(str(pr))
    if not found:
        return set(), ""
    if not found.get("why", "").strip() or not found.get("leave_out"):
        raise TriageError(f"{path.name}: PR {pr} must give leave_out (test node ids) and why")
    return set(found["leave_out"]), " ".join(found["why"].split())


def fix_ids(applied: str) -> list[str]:
    """The fixes a run applied: ``applied`` is one id or several joined by commas (``FIXBOOK_TRIAGE_APPLY``)."""
    return [i for i in applied.split(",") if i]


def fix_proof(run: ReleaseRun, entry: str) -> tuple[bool, str]:
    """Whether ``run`` ran with ``entry``'s fix (each of them, for ``a,b``) in every process its tests started, from
    each process's own record:
    the pytest process's line and one per rank that joined a process group. Every line must hold the fix, and for
    each world size the ranks recorded must be 0..W-1 the same number of times each (a rank that wrote no line would
    leave a gap). Returns (proven, what the record shows)."""
    lines = run.processes
    wanted = set(fix_ids(entry))
    main = [p for p in lines if p.get("rank") == "pytest"]
    ranks = [p for p in lines if isinstance(p.get("rank"), int)]
    if not main:
        if not lines and run.fix_log:
            return False, ("the run predates each process's record of its fixes (its log says only: "
                           f"{'; '.join(run.fix_log)[:200]})")
        return False, "the pytest process wrote no record of its fixes"
    lacking = [p for p in lines if not wanted <= set(p.get("applied", []))]
    if lacking:
        where = ", ".join(f"{_process_name(p)} (pid {p.get('pid')})" for p in lacking[:4])
        return False, f"{len(lacking)} of {len(lines)} processes did not hold the fix: {where}"
    for world in sorted({p.get("world_size") for p in ranks}):
        counts = [sum(1 for p in ranks if p.get("world_size") == world and p["rank"] == r) for r in range(world)]
        if len(set(counts)) != 1 or counts[0] == 0:
            return False, (f"ranks of world size {world} recorded unevenly ({', '.join(f'rank {r}: {n}' for r, n in enumerate(counts))}): "
                           "a rank wrote no record")
    worlds = sorted({p.get("world_size") for p in ranks})
    if not ranks:
        return True, "held in the pytest process (the tests started no ranks)"
    return True, (f"held in the pytest process and in all {len(ranks)} rank processes (world sizes "
                  f"{', '.join(map(str, worlds))})")


def _process_name(line: dict[str, Any]) -> str:
    if line.get("rank") == "pytest":
        return "the pytest process"
    return f"rank {line.get('rank')} of {line.get('world_size')}"


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _tail(text: str, lines: int = 6) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-600:]


def read_report(report: Path, tests: list[str], hung: bool = False) -> list[TestResult]:
    """The cases ``ci/triage/upstream_site/fixbook_triage_report.py`` wrote, each under the selected test it belongs to
    (parametrizations share it). A module that failed to import is an error of every selected test of its file. With
    ``hung`` (upstream's launcher gave up on a test: ``Test hanged, exiting``), a case that started and never ended
    failed by hanging; otherwise such a case was cut off by the run's own timeout and is left out."""
    results = []
    started: dict[str, bool] = {}  # case -> ended
    for line in report.read_text().splitlines() if report.exists() else []:
        try:
            case = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        node_id = case["node"]
        node = node_id.split("[")[0]
        if case["outcome"] == "started":
            started[node_id] = False
            continue
        started[node_id] = True
        if case["outcome"] == "hung":  # the reporter's watchdog ended the run on this case
            if node in tests:
                results.append(TestResult(node, "failed", HUNG, node_id))
            continue
        if node in tests:
            results.append(TestResult(node, case["outcome"], case.get("message", ""), node_id))
        elif case.get("when") == "collect":
            for test in tests:
                if test.split("::")[0] == node_id.split("::")[0]:
                    results.append(TestResult(test, "error", case.get("message", ""), test))
    for node_id, ended in started.items():
        if hung and not ended and node_id.split("[")[0] in tests:
            results.append(TestResult(node_id.split("[")[0], "failed", HUNG, node_id))
    return results


HUNG = f"hung: no result within upstream's hang limit ({HANG_S} s)"


def _first_line_of(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


# ---- a row: before, then after -------------------------------------------------------------------------------

@dataclass
class Outcome:
    """What the triage found for one census row."""

    key: str
    pr: int | None
    sha: str
    component: str
    symptom: str
    state: str
    reason: str
    before: str = ""  # the last release without the fix
    after: str = ""  # the first release with it
    tests: list[str] = field(default_factory=list)  # the tests the machine ran (reproduced: the ones that did)
    selection: list[str] = field(default_factory=list)  # how they were chosen, per file
    runs: list[ReleaseRun] = field(default_factory=list)
    command: str = ""
    date: str = ""
    grid: dict[str, Any] = field(default_factory=dict)  # the grid's decision of a row without upstream test (.grid)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Outcome":
        data = dict(data)
        runs = [ReleaseRun(**run) for run in data.pop("runs", [])]
        return cls(**data, runs=runs)


_MISSING_NAME = re.compile(r"cannot import name '(\w+)'|has no attribute '(\w+)'|unexpected keyword argument '(\w+)'"
                           r"|No module named '([\w.]+)'")


def needs_fix_api(message: str, added: str) -> str:
    """The name a failure says is missing, where the fix commit adds it (``added``: its added source lines); "" where
    the failure is something else. Such a failure shows the old release lacks the fix's API, not the bug."""
    found = _MISSING_NAME.search(message)
    name = next((g for g in found.groups() if g), "") if found else ""
    last = name.rsplit(".", 1)[-1]
    return name if name and re.search(rf"\b{re.escape(last)}\b", added) else ""


USES_THE_FIX = "upstream's test uses what the fix adds"


def grid_decides(outcome: "Outcome") -> bool:
    """Whether the differential sweep's grid is what decides this row (``python -m ci.triage.grid``): its fix ships
    no test, or its test uses what the fix adds and so cannot run without it."""
    return outcome.state == NO_TEST or (outcome.state == COULD_NOT_RUN and outcome.reason.startswith(USES_THE_FIX))


def classify(before: ReleaseRun, after: ReleaseRun | None, added: str = "") -> tuple[str, str, list[str]]:
    """(state, reason, the tests that carry it) from the run on the last release without the fix and, where that
    one failed, the run on the first release with it. ``added``: the fix commit's added source lines; a test that
    fails before only because it uses what the fix adds (an import, an attribute, a keyword) reproduces nothing."""
    if before.timed_out and not before.ran:
        return COULD_NOT_RUN, f"timed out on {before.release} after {before.duration_s:.0f} s", []
    if before.crashed and not before.ran:
        if ACCELERATOR_WORDS.search(before.crashed):
            return ACCELERATOR, f"on {before.release}: {before.crashed[:300]}", []
        return COULD_NOT_RUN, f"on {before.release}: {before.crashed[:300]}", []
    if not before.failing:
        if before.passing:
            skipped = f"; {before.skipped} skipped" if before.skipped else ""
            return NOT_DETECTED, (f"{len(before.passing)} test cases pass on {before.release}, "
                                  f"the last release without the fix{skipped}"), before.passing
        if before.accelerator_only:
            return ACCELERATOR, f"every test skipped on CPU ({'; '.join(before.skips)[:300]})", []
        return COULD_NOT_RUN, f"nothing ran on {before.release}: {'; '.join(before.skips)[:300] or 'no test collected'}", []
    if after is None:
        return COULD_NOT_RUN, f"{len(before.failing)} tests fail on {before.release}; no release with the fix to compare", []
    repaired = [t for t in before.failing if t in after.passing]
    api = {t: needs_fix_api(before.failures.get(t, ""), added) for t in repaired}
    if repaired and all(api.values()):
        names = ", ".join(sorted(set(api.values())))
        return COULD_NOT_RUN, (f"{USES_THE_FIX} ({names}): it cannot run on {before.release} "
                               "at all, so it says nothing of the bug there; a scripted reproduction is needed"), []
    repaired = [t for t in repaired if not api[t]]
    if repaired:
        return REPRODUCED, (f"{len(repaired)} tests fail on {before.release} and pass on {after.release}: "
                            + "; ".join(f"{t.split('::')[-1]}: {before.failures.get(t, '')[:150]}" for t in repaired[:3])), repaired
    if before.accelerator_only and (after.accelerator_only or not after.ran):
        return ACCELERATOR, "fails on CPU for want of a GPU before and after the fix: " + \
            "; ".join(list(before.failures.values())[:2])[:300], []
    if after.timed_out and not after.ran:
        return COULD_NOT_RUN, f"fails on {before.release}; timed out on {after.release}", []
    return COULD_NOT_RUN, (f"fails on {before.release} and on {after.release}, the first release with the fix, too: "
                           + "; ".join(list(after.failures.values())[:2] or [after.crashed])[:300]), []


def neighbours(first: str, releases: list[str]) -> tuple[str | None, str]:
    """(the last release before ``first``, ``first``) in ``releases`` (oldest first)."""
    from fixes.versions import parse

    earlier = [r for r in releases if parse(r) < parse(first)]
    return (earlier[-1] if earlier else None), first


@dataclass
class Triage:
    """The machine: a clone, the releases (oldest first) and where each is installed."""

    clone: Clone
    releases: list[str]
    release_dir: Callable[[str], Path]
    install: Callable[[str], None] = lambda release: None
    timeout: float = TIMEOUT_S
    cache: Path = CACHE
    clone_arg: str = "PATH"
    hang: float = HANG_S
    pin_pytest: bool = False  # run with the pytest DeepSpeed's tests pin (--entries; the backlog rows keep theirs)

    def first_release_with(self, row: Row, commit: str) -> str | None:
        """The census's first release, or for a row no release of the snapshot had, the first installed release
        whose source has the fix's added lines (:func:`contains_fix`)."""
        if row.first_release and row.first_release in self.releases:
            return row.first_release
        added = self.clone.added_source_lines(commit)
        from fixes.versions import parse

        newer = [r for r in self.releases if not row.first_release or parse(r) > parse(row.first_release)]
        for release in newer:
            self.install(release)
            if contains_fix(added, self.release_dir(release)):
                return release
        return None

    def command(self, row: Row, release: str | None = None, apply: str = "") -> str:
        parts = ["python -m ci.triage", f"--ds-clone {self.clone_arg}", f"--pr {row.key}"]
        if apply:
            parts = ["python -m ci.triage", f"--ds-clone {self.clone_arg}", f"--entry {apply}"]
        if release:
            parts.append(f"--release {release}")
        return " ".join(parts + ["--force"])

    def selection(self, row: Row, commit: str) -> tuple[list[str], list[str]]:
        tests, how = [], []
        for path, changed in sorted(self.clone.changed_tests(commit).items()):
            chosen, why = select_tests(self.clone.show(commit, path), path, changed)
            tests += chosen
            how.append(why)
        return tests, how

    def pytest_for(self, commit: str) -> PytestChoice | None:
        """With ``pin_pytest``, the pytest that the fix commit's ``requirements/requirements-dev.txt`` pins for
        DeepSpeed's own tests: this Python's where it satisfies the pin, else one installed apart. Where the commit's
        ``tests/unit/common.py`` marks its distributed fixtures the way only pytest before 8.4 reads
        (:data:`OLD_FIXTURE_MARKER`), every run of it, a backlog row's too, takes such a pytest: with a newer one those
        fixtures are "not found" and nothing of the bug is measured."""
        from packaging.specifiers import SpecifierSet

        old_marker = OLD_FIXTURE_MARKER in self.clone.show(commit, "tests/unit/common.py", missing_ok=True)
        if not self.pin_pytest and not old_marker:
            return None
        pin = pytest_pin(self.clone.show(commit, "requirements/requirements-dev.txt", missing_ok=True))
        if old_marker and "8.4.0" in SpecifierSet(pin):
            pin = ",".join(filter(None, (pin, "<8.4")))
        current = _pytest_version()
        chosen = choose_pytest(pin, current)
        return PytestChoice(current, pin) if chosen is None else PytestChoice(chosen, pin, install_pytest(chosen, self.cache))

    def run_release(self, row: Row, commit: str, tests: list[str], release: str, apply: str = "") -> ReleaseRun:
        self.install(release)
        if any(test.count("::") > 1 for test in tests):  # a test class: upstream's
            clear_stale_build_locks(ROOT / ".cache" / "torch_extensions" / release)  # DistributedTest ones start ranks
            build_ops(release, self.release_dir(release), timeout=self.timeout)
        tests_dir = self.clone.extract_tests(commit, self.cache / commit[:12])
        return run_tests(tests_dir, tests, release, self.release_dir(release), timeout=self.timeout, apply=apply,
                         command=self.command(row, release, apply), hang=self.hang, pytest=self.pytest_for(commit))

    def triage(self, row: Row, known: Outcome | None = None, only_release: str | None = None) -> Outcome:
        """The row's outcome: its tests on the release before the fix, then (where they fail) on the first with
        it. Runs ``known`` already holds for the same tests and release are reused."""
        from fixes.versions import parse

        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        base = dict(key=row.key, pr=row.pr, sha=row.sha, component=row.component, symptom=row.symptom,
                    command=self.command(row), date=date)
        try:
            commit = self.clone.commit(row)
        except TriageError as exc:
            return Outcome(**base, state=COULD_NOT_RUN, reason=str(exc))
        tests, how = self.selection(row, commit)
        if not tests and known is not None and known.grid:
            return known  # decided by the grid (python -m ci.triage.grid), which a run here cannot add to
        if not tests:
            files = sorted(self.clone.added_source_lines(commit))
            return Outcome(**base, state=NO_TEST, selection=how, reason=(
                "the fix commit adds or changes no test function: a scripted reproduction is needed, of "
                f"{row.note or row.subject}" + (f" (the fix changed {', '.join(files[:4])}"
                                                 f"{' and more' if len(files) > 4 else ''})" if files else "")))
        if row.first_release and parse(row.first_release) <= parse(self.releases[0]):
            before = self.clone.release_before(row.first_release)
            return Outcome(**base, state=COULD_NOT_RUN, tests=tests, selection=how, after=row.first_release,
                           reason=(f"first released in {row.first_release}: the last release without the fix"
                                   f"{f' ({before})' if before else ''} is older than {self.releases[0]}, the oldest "
                                   "release the triage runs (the release sweep's, in the project's environment; "
                                   "ci/releases.toml [[older]] says what older releases need)"))
        first = self.first_release_with(row, commit)
        if first is None:
            return Outcome(**base, state=COULD_NOT_RUN, tests=tests, selection=how,
                           reason="no installed release has the fix yet (its added code is in none of them)")
        before_release, after_release = neighbours(first, self.releases)
        if before_release is None:
            return Outcome(**base, state=COULD_NOT_RUN, tests=tests, selection=how, after=after_release,
                           reason=f"no release before {after_release} in the release set")

        def reuse_or_run(release: str) -> ReleaseRun:
            if known and only_release not in (release,):
                for old in known.runs:
                    if old.release == release and old.tests == tests and not old.applied:
                        return old
            return self.run_release(row, commit, tests, release)

        before = reuse_or_run(before_release)
        after = reuse_or_run(after_release) if before.failing else None
        added = "\n".join(line for lines in self.clone.added_source_lines(commit).values() for line in lines)
        state, reason, carrying = classify(before, after, added)
        if known is not None and known.grid and state == COULD_NOT_RUN and reason.startswith(USES_THE_FIX):
            return known  # decided by the grid, which upstream's test cannot speak against
        waiting = waiting_point([line for run in (before, after) if run is not None for line in run.stacks])
        if "hung" in reason and waiting:
            reason += f" (waiting at {waiting}; every process's place is in the run's stacks)"
        return Outcome(**base, state=state, reason=reason, before=before_release, after=after_release,
                       tests=carrying or tests, selection=how, runs=[before] + ([after] if after else []))

    def with_fix(self, row: Row, entry: str, release: str, known_without: ReleaseRun | None = None,
                 also: tuple[str, ...] = (), known_with: ReleaseRun | None = None) -> dict[str, Any]:
        """Upstream's fix-PR test for ``row`` on ``release`` (an entry's last affected one) without and with
        ``fixes.apply(entry)`` — and ``also``: the other entries citing the same PR, affected on ``release`` and measured
        fixed from the same release (the PR fixes their bugs together, and its test may trip over any of them),
        applied with it in every process.
        Test cases :func:`scope` leaves out for the PR (another change of the PR, which no entry claims) are not run;
        the record says which and why. ``known_without``: a recorded run without any fix of the same tests on the
        same release with the same pytest (another entry citing the PR), reused instead of run again; ``known_with``
        likewise a recorded run of the same tests with the same set of fixes applied."""
        commit = self.clone.commit(row)
        tests, how = self.selection(row, commit)
        left_out, why = scope(row.pr)
        if left_out:
            tests = [test for test in tests if test not in left_out]
            how = how + [f"left out: {', '.join(sorted(left_out))} ({why})"]
        if not tests:
            return {"entry": entry, "pr": row.pr, "release": release, "state": NO_TEST, "selection": how}
        applied = ",".join((entry, *also))
        choice = self.pytest_for(commit)
        reusable = (known_without is not None and known_without.tests == tests and known_without.release == release
                    and not known_without.applied and choice is not None
                    and known_without.pytest == choice.describe())
        same_fixes = (known_with is not None and known_with.tests == tests and known_with.release == release
                      and set(fix_ids(known_with.applied)) == set(fix_ids(applied)) and choice is not None
                      and known_with.pytest == choice.describe())
        with ThreadPoolExecutor(max_workers=2) as pool:  # the two runs are independent: side by side
            plain = None if reusable else pool.submit(self.run_release, row, commit, tests, release)
            fixed = None if same_fixes else pool.submit(self.run_release, row, commit, tests, release, apply=applied)
            without = known_without if plain is None else plain.result()
            with_ = known_with if fixed is None else fixed.result()
        verdict, reason = entry_verdict(without, with_, applied)
        if also:
            reason = applied_together(reason, release, [entry, *also])
        if left_out:
            reason += f". Left out: {len(left_out)} test cases of the PR ({why})"
        reason = " ".join(reason.split())  # one line: the card's table cell
        return {"entry": entry, "pr": row.pr, "release": release, "verdict": verdict, "reason": reason,
                "proof": fix_proof(with_, applied)[1], "tests": tests, "applied": list(fix_ids(applied)),
                "selection": how, "without": asdict(without), "with": asdict(with_),
                "command": self.command(row, release, apply=entry), "date": without.date}


FIX_PASSES = "the fix makes upstream's test pass"
STILL_FAILS = "upstream's test still fails with the fix"
PASSES_WITHOUT = "upstream's test passes without the fix too (it does not detect the bug on CPU)"
DID_NOT_RUN = "upstream's test could not run on CPU"
NOT_PROVEN = "not measured with the fix"
PASSES_WHERE_RAN = "the fix makes upstream's test pass where it ran (some cases could not run)"
VERDICTS = (FIX_PASSES, PASSES_WHERE_RAN, STILL_FAILS, PASSES_WITHOUT, DID_NOT_RUN, NOT_PROVEN)


def _why_nothing_ran(run: ReleaseRun) -> str:
    """What a run where no test reached a result shows instead: its errors, skips, crash or timeout."""
    said = []
    if run.errors:
        said.append(f"{run.errors} errors, e.g. {next(iter(run.failures.values()), '')[:200]}")
    if run.skipped:
        said.append(f"{run.skipped} skipped ({'; '.join(run.skips)[:200]})")
    if run.crashed:
        said.append(f"crashed: {run.crashed[:200]}")
    if run.timed_out:
        said.append(f"timed out after {run.duration_s:.0f} s")
    used = (f"pytest {run.pytest.split(' (')[0]}" if run.pytest
            else "the pytest it ran under was not recorded (before runs used the one DeepSpeed pins)")
    return ("; ".join(said) or "no test collected") + f"; {used}"


def entry_verdict(without: ReleaseRun, with_: ReleaseRun, entry: str) -> tuple[str, str]:
    """(verdict, its measured reason) for upstream's test run without and with ``entry``'s fix on one release.

    Errors (collection, fixture set-up) and skips are not results: a side where no test case passed or failed could
    not run, and says so with what it showed instead, never "still fails". The run with the fix counts only where
    every process it started held the fix (:func:`fix_proof`). "Still fails" names the failures the fix leaves."""
    if not without.tests_ran:
        return DID_NOT_RUN, f"without the fix no test ran on {without.release}: {_why_nothing_ran(without)}"
    if not with_.tests_ran:
        return DID_NOT_RUN, f"with the fix no test ran on {with_.release}: {_why_nothing_ran(with_)}"
    proven, proof = fix_proof(with_, entry)
    if not without.failed:  # whatever the run with the fix shows, the test does not detect the bug here
        return PASSES_WITHOUT, (f"{without.passed} test cases pass on {without.release} without the fix; "
                                f"with it {with_.passed} pass, {with_.failed} fail; {proof}")
    if not proven:
        return NOT_PROVEN, f"the run with the fix does not count: {proof}"
    if with_.timed_out and not with_.failed:
        return PASSES_WHERE_RAN, (f"{without.failed} failing without the fix; with it {with_.passed} passed and none "
                                  f"failed before the run was cut off at {with_.duration_s:.0f} s; {proof}")
    if not with_.failed and not with_.errors:
        return FIX_PASSES, f"{without.failed} failing without the fix, none with it; {proof}"
    if not with_.failed:
        return PASSES_WHERE_RAN, (f"{without.failed} failing without the fix, none with it, but {with_.errors} errors "
                                  f"with it (no result): {next(iter(with_.failures.values()), '')[:200]}; {proof}")
    left = [f"{case.split('::', 1)[-1]}: {message[:200]}" for case, message in with_.failures.items()]
    found = [_MISSING_NAME.search(message) for message in with_.failures.values()]
    names = sorted({next(g for g in match.groups() if g) for match in found if match})
    api = (f"upstream's test uses an API DeepSpeed {with_.release} lacks ({', '.join(names)}); "
           if found and all(found) else "")
    return STILL_FAILS, (f"{api}{with_.failed} failed and {with_.errors} errors with the fix ({proof}): "
                         + "; ".join(left[:3]) + by_file(without, with_) + cut_off(without, with_))[:1400]


def cut_off(without: ReleaseRun, with_: ReleaseRun) -> str:
    """Where the run with the fix reached its time limit: how many cases ended, against the run without it."""
    if not with_.timed_out:
        return ""
    ended, before = with_.passed + with_.failed + with_.skipped, without.passed + without.failed + without.skipped
    return (f". The run with the fix was cut off at its time limit ({with_.duration_s:.0f} s): {ended} cases ended, "
            f"against {before} without it")


def by_file(without: ReleaseRun, with_: ReleaseRun) -> str:
    """Where the selected tests span several files: per file, the cases failing without and with the fix (a file the
    fix makes pass is told apart from one it does not)."""
    files = sorted({case.split("::")[0] for case in [*without.failing, *without.passing, *with_.failing,
                                                     *with_.passing]})
    if len(files) < 2:
        return ""

    def count(cases: list[str], path: str) -> int:
        return sum(case.split("::")[0] == path for case in cases)

    parts = []
    for path in files:
        before, after, passing = count(without.failing, path), count(with_.failing, path), count(with_.passing, path)
        said = ("the fix makes it pass" if before and not after and passing else
                "still fails with the fix" if after else "passes without the fix too" if not before else "")
        parts.append(f"{path}: {before} failing without the fix, {after} with it ({passing} passing): {said}")
    return ". By file: " + "; ".join(parts)


# ---- the record ------------------------------------------------------------------------------------------------

# Paths of the machine that ran a triage, as its errors print them: a release's installed files, the tests'
# working copy and the ops built for a release. The record keeps them relative (they reach the Coverage page and the
# census data).
_MACHINE_PATHS = ((re.compile(r"(/[^\s'\"/:|]+)+/\.deepspeed/[^\s'\"/:|]+/"), "site-packages/"),
                  (re.compile(r"(/[^\s'\"/:|]+)+/\.cache/triage/[^\s'\"/:|]+/"), ""),
                  (re.compile(r"(/[^\s'\"/:|]+)+/\.cache/torch_extensions/"), "torch_extensions/"))


def portable(text: str) -> str:
    """``text`` without this machine's paths: a release's files as ``site-packages/...``, a test as its path in the
    DeepSpeed repository (``tests/unit/...``)."""
    for pattern, replacement in _MACHINE_PATHS:
        text = pattern.sub(replacement, text)
    return text


def load(path: Path = DATA) -> dict[str, Any]:
    if not path.exists():
        return {"rows": {}, "entries": {}, "sessions": []}
    data = json.loads(path.read_text())
    data.setdefault("entries", {})
    data.setdefault("sessions", [])
    return data


def save(data: dict[str, Any], path: Path = DATA, *, rows: Iterable[str] = (), entries: Iterable[str] = (),
         session: dict[str, Any] | None = None) -> None:
    """Write the named ``rows`` and ``entries`` of ``data`` (and a new ``session``) into the record at ``path``,
    keeping everything else there: another triage may be recording other rows at the same time."""
    from fixes.files import locked, write_atomic

    with locked(path):
        kept = load(path)
        kept["rows"].update({key: data["rows"][key] for key in rows})
        kept["entries"].update({key: data["entries"][key] for key in entries})
        if session:
            kept["sessions"].append(session)
        kept["rows"] = dict(sorted(kept["rows"].items()))
        kept["entries"] = dict(sorted(kept["entries"].items()))
        write_atomic(path, portable(json.dumps(kept, indent=1, ensure_ascii=False)) + "\n")


def outcomes(data: dict[str, Any] | None = None) -> dict[str, Outcome]:
    data = load() if data is None else data
    return {key: Outcome.from_json(row) for key, row in data["rows"].items()}


def _cited() -> dict[str, tuple[int, ...]]:
    import fixes

    return {fix.id: tuple(fix.info.upstream_prs) for fix in fixes.all_fixes()
            if fix.info.sweep and fix.info.sweep.affected}


def unmeasured_entries(data: dict[str, Any], cited: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Each entry's cited PR whose upstream test has no record yet, with the command that measures it: the entry
    cards say "not measured yet" for these, and ``--check`` lists them (they are work to do, not a broken record)."""
    cited = _cited() if cited is None else cited
    return [f"entry {entry}: PR #{pr}'s upstream test has no record yet (python -m ci.triage --ds-clone PATH "
            f"--entries --entry {entry})" for entry, prs in sorted(cited.items()) for pr in prs
            if f"{entry}#{pr}" not in data["entries"]]


def check_entries(data: dict[str, Any], cited: dict[str, tuple[int, ...]] | None = None) -> list[str]:
    """Problems with the entries' upstream-test records: "still fails" on a run where no test ran or without its
    measured reason (``cited``: each entry's PRs, default the registered entries' that have an affected release).
    A cited PR with no record yet is not a problem of the record but work still to do: :func:`unmeasured_entries`."""
    cited = _cited() if cited is None else cited
    problems = []
    for entry, prs in sorted(cited.items()):
        for pr in prs:
            result = data["entries"].get(f"{entry}#{pr}")
            if result is None:
                continue
            if result.get("verdict") == STILL_FAILS:
                if not result.get("reason"):
                    problems.append(f"entry {entry}: PR #{pr} still fails with the fix but the record gives no reason")
                if not (result["with"].get("passed") or result["with"].get("failed")):
                    problems.append(f"entry {entry}: PR #{pr} is recorded as still failing on a run where no test ran")
    return problems


def check(data: dict[str, Any] | None = None, rows: list[Row] | None = None, entries: bool = True) -> list[str]:
    """Problems with the record: a backlog row without an outcome, an outcome without its command or date, a state
    that is not one of :data:`STATES`; with ``entries``, those of :func:`check_entries`."""
    data = load() if data is None else data
    recorded = outcomes(data)
    problems = check_entries(data) if entries and rows is None else []
    for row in backlog() if rows is None else rows:
        outcome = recorded.get(row.key)
        if outcome is None:
            problems.append(f"row {row.key} ({row.component}, {row.subject[:60]}): no recorded outcome")
            continue
        if outcome.state not in STATES:
            problems.append(f"row {row.key}: unknown state {outcome.state!r}")
        if not outcome.command or not outcome.date:
            problems.append(f"row {row.key}: the outcome lacks its command or date")
        for run in outcome.runs:
            if not run.command or not run.date:
                problems.append(f"row {row.key}: the run on {run.release} lacks its command or date")
    return problems


SYMPTOM_RANK = {"silent-wrong": 0, "data-loss": 0, "hang": 1, "crash": 2}
COMPONENT_RANK = {"ZeRO-3": 0, "checkpoint": 0}


def ranked(data: dict[str, Any] | None = None, rows: list[Row] | None = None) -> list[tuple[Row, Outcome]]:
    """The rows upstream's test reproduces and no entry measures yet, silent wrong results and data loss first,
    then hangs, then crashes; ZeRO-3 and checkpoints first within a class; newer fixes first after that. A row the
    census triage decided by hand (``ci/data/census_triage.toml``: a duplicate of an entry, say) is not ranked."""
    import tomllib

    import fixes

    cited = {pr for fix in fixes.all_fixes() for pr in fix.info.upstream_prs}
    hand = tomllib.loads(CENSUS_TRIAGE.read_text()).get("rows", {}) if CENSUS_TRIAGE.exists() else {}
    cited |= {int(pr) for pr in hand}
    recorded = outcomes(data)
    chosen = [(row, recorded[row.key]) for row in (backlog() if rows is None else rows)
              if row.key in recorded and recorded[row.key].state in (REPRODUCED, GRID_REPRODUCED) and row.pr not in cited]
    return sorted(chosen, key=lambda pair: (SYMPTOM_RANK.get(pair[0].symptom, 3),
                                            COMPONENT_RANK.get(pair[0].component, 1), -(pair[0].pr or 0)))


def summary(data: dict[str, Any] | None = None, rows: list[Row] | None = None) -> str:
    recorded = outcomes(data)
    rows = backlog() if rows is None else rows
    states: dict[str, int] = {}
    by_component: dict[str, dict[str, int]] = {}
    for row in rows:
        state = recorded[row.key].state if row.key in recorded else "not tried"
        states[state] = states.get(state, 0) + 1
        by_component.setdefault(row.component, {}).setdefault(state, 0)
        by_component[row.component][state] += 1
    lines = [f"{len(rows)} backlog rows: " + ", ".join(f"{states.get(s, 0)} {s}" for s in (*STATES, "not tried")
                                                      if states.get(s, 0) or s != "not tried")]
    for component, counts in sorted(by_component.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"  {component}: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(lines)


# ---- the command line ----------------------------------------------------------------------------------------

def _machine(clone_path: Path, timeout: float) -> Triage:
    import threading

    from fixes import measured

    from .. import releases as release_env

    installing = threading.Lock()

    def install(release: str) -> None:  # one at a time: two rows may want the same missing release
        with installing:
            release_env.install(release)

    return Triage(Clone(clone_path), list(measured.load().releases), release_env.install_dir, install,
                  timeout=timeout)


def run_rows(machine: Triage, rows: list[Row], data: dict[str, Any], *, jobs: int = 2, force: bool = False,
             only_release: str | None = None, save_to: Path | None = DATA, session: bool = True) -> list[Outcome]:
    """Triage ``rows`` ``jobs`` at a time, saving each outcome as it ends (a stopped run keeps what ended). With
    ``session``, the record keeps this pass's rows, runs executed and wall time (rows per hour)."""
    import threading

    lock = threading.Lock()
    done: list[Outcome] = []
    started = time.monotonic()

    def one(row: Row) -> Outcome:
        known = None if force else (Outcome.from_json(data["rows"][row.key]) if row.key in data["rows"] else None)
        try:
            outcome = machine.triage(row, known, only_release)
        except Exception as exc:  # noqa: BLE001 - one row's failure is that row's record, the rest go on
            outcome = Outcome(row.key, row.pr, row.sha, row.component, row.symptom, COULD_NOT_RUN,
                              f"the triage itself failed: {type(exc).__name__}: {exc}"[:400],
                              command=machine.command(row), date=datetime.now(timezone.utc).strftime("%Y-%m-%d"))
        with lock:
            data["rows"][row.key] = asdict(outcome)
            done.append(outcome)
            if save_to:
                save(data, save_to, rows=[row.key])
            runs = ", ".join(run.brief() for run in outcome.runs)
            print(f"[{len(done)}/{len(rows)}] #{row.key} {row.component}: {outcome.state} "
                  f"({sum(r.duration_s for r in outcome.runs):.0f} s) {runs}", flush=True)
        return outcome

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(one, rows))
    wall = time.monotonic() - started
    if rows and session:
        record = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "rows": len(rows),
                  "wall_s": round(wall, 1), "jobs": jobs,
                  "rows_per_hour": round(len(rows) / wall * 3600, 1) if wall else None}
        data["sessions"].append(record)
        if save_to:
            save(data, save_to, session=record)
    return done


def pending(rows: Iterable[Row], data: dict[str, Any]) -> list[Row]:
    """The rows without a recorded outcome, or whose outcome a later run may change (``could not run``)."""
    return [row for row in rows if row.key not in data["rows"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.triage", description=__doc__.splitlines()[0])
    parser.add_argument("--ds-clone", type=Path, help="a DeepSpeed git repository (a bare mirror will do)")
    parser.add_argument("--pr", action="append", help="census row by PR number (repeatable; default: the backlog)")
    parser.add_argument("--component", action="append", help="only the backlog rows of this component (repeatable)")
    parser.add_argument("--release", help="with --pr: run only this release of the row's pair")
    parser.add_argument("--all", action="store_true", help="every census row, not only the backlog")
    parser.add_argument("--entries", action="store_true", help="each entry's cited PR test, without and with its fix")
    parser.add_argument("--entry", action="append",
                        help="with --entries: only this entry (repeatable; with --reclassify also ID#PR)")
    parser.add_argument("--force", action="store_true", help="run again what is recorded")
    parser.add_argument("--reclassify", action="store_true",
                        help="the recorded rows again with the current rules, reusing their runs (running only a "
                             "run a rule now needs)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per (row, release) run")
    parser.add_argument("--limit", type=int, help="at most this many rows this time")
    parser.add_argument("--check", action="store_true", help="exit 1 if a backlog row lacks an outcome, command or date")
    parser.add_argument("--next", action="store_true", help="the ranked list of next entries")
    parser.add_argument("--summary", action="store_true", help="counts per state and per component")
    args = parser.parse_args(argv)
    data = load()
    if args.check:
        problems = check(data)
        for problem in problems:
            print(problem, file=sys.stderr)
        for line in unmeasured_entries(data):
            print(line)
        print(summary(data))
        return 1 if problems else 0
    if args.summary:
        print(summary(data))
        for session in data["sessions"]:
            print(f"  run {session['date']}: {session['rows']} rows in {session['wall_s']:.0f} s, {session['jobs']} "
                  f"at a time ({session['rows_per_hour']} rows per hour)")
        timed = [s for s in data["sessions"] if s["wall_s"] >= 60]  # a pass that ran tests (seconds: nothing to run)
        if timed:
            rows_done, wall = sum(s["rows"] for s in timed), sum(s["wall_s"] for s in timed)
            print(f"  in all: {rows_done} rows in {wall / 3600:.1f} h of wall time ({rows_done / wall * 3600:.1f} rows "
                  "per hour)")
        return 0
    if args.next:
        for number, (row, outcome) in enumerate(ranked(data), 1):
            print(f"{number:3d}. #{row.pr} {row.component}, {row.symptom}: {row.subject[:70]} — {outcome.reason[:110]}")
        return 0
    if args.entries and args.reclassify:
        return reclassify_entries(data, args.entry)
    if args.ds_clone is None:
        parser.error("--ds-clone PATH is needed to run upstream's tests (a clone of deepspeedai/DeepSpeed)")
    machine = _machine(args.ds_clone, args.timeout)
    rows = census_rows() if args.all else backlog()
    if args.entries:
        return _run_entries(machine, data, args.entry, args.force, {int(pr) for pr in args.pr or []})
    if args.pr:
        wanted = set(args.pr)
        rows = [row for row in census_rows() if row.key in wanted]
        missing = wanted - {row.key for row in rows}
        if missing:
            raise SystemExit(f"error: no census row for {', '.join(sorted(missing))}")
    if args.component:
        rows = [row for row in rows if row.component in args.component]
    if args.reclassify:
        rows = [row for row in rows if row.key in data["rows"]]
    elif not args.force and not args.pr:
        rows = pending(rows, data)
    rows = sorted(rows, key=lambda row: (COMPONENT_RANK.get(row.component, 1), row.component, -(row.pr or 0)))
    rows = rows[:args.limit] if args.limit else rows
    print(f"{len(rows)} rows to triage, {args.jobs} at a time", flush=True)
    run_rows(machine, rows, data, jobs=args.jobs, force=args.force, only_release=args.release,
             session=not args.reclassify)
    print(summary(data))
    return 0


def applied_together(reason: str, release: str, entries: list[str]) -> str:
    """An entry's verdict ``reason`` for a run with the fixes of several entries (those whose bugs one PR fixes),
    saying so: the wording of :meth:`Triage.with_fix` and :func:`reclassify_entries` alike."""
    return (f"with the fixes of the entries whose bugs this PR fixes together, each affected on {release}, "
            f"applied together ({', '.join(entries)}): " + reason)


def reclassify_entries(data: dict[str, Any], only: list[str] | None = None, save_to: Path | None = DATA) -> int:
    """The recorded entries' verdicts again with the current rules (:func:`entry_verdict`), from their recorded runs:
    nothing is run. A run recorded before each process wrote its record of fixes is not a run with the fix. ``only``:
    entry ids or record keys (``ID#PR``)."""
    changed = []
    for key, result in data["entries"].items():
        if (only and result["entry"] not in only and key not in only) or "without" not in result or "with" not in result:
            continue
        without, with_ = ReleaseRun(**result["without"]), ReleaseRun(**result["with"])
        applied = ",".join(result.get("applied") or [result["entry"]])
        verdict, reason = entry_verdict(without, with_, applied)
        if result.get("applied", [result["entry"]])[1:]:
            reason = applied_together(reason, result["release"], result["applied"])
        left_out, why = scope(result["pr"])
        if left_out and any(line.startswith("left out: ") for line in result.get("selection", [])):
            reason += f". Left out: {len(left_out)} test cases of the PR ({why})"
        updated = {**result, "verdict": verdict, "reason": " ".join(reason.split()),
                   "proof": fix_proof(with_, applied)[1]}
        if updated != result:
            print(f"{key}: {result['verdict']} -> {verdict}", flush=True)
            data["entries"][key] = updated
            changed.append(key)
    if save_to and changed:
        save(data, save_to, entries=changed)
    return 0


def _run_entries(machine: Triage, data: dict[str, Any], only: list[str] | None, force: bool,
                 prs: set[int] | None = None) -> int:
    """Item 5: each entry's cited PR that ships a test, on the entry's last affected release, without and with
    ``fixes.apply()``; kept under ``entries`` in the record."""
    import fixes

    machine.pin_pytest = True
    rows = {row.pr: row for row in census_rows() if row.pr}
    for fix in fixes.all_fixes():
        if only and fix.id not in only:
            continue
        affected = fix.info.sweep.affected if fix.info.sweep else []
        if not affected:
            continue
        release = affected[-1]
        for pr in fix.info.upstream_prs:
            if prs and pr not in prs:  # --pr: only these of the entry's PRs
                continue
            row = rows.get(pr) or Row(pr, "", None, "", "", "", False)
            key = f"{fix.id}#{pr}"
            if key in data["entries"] and not force:
                continue
            # --force runs both again; otherwise a run recorded for another entry citing the PR is reused
            known = None if force else next((ReleaseRun(**r["without"]) for r in data["entries"].values()
                          if r.get("pr") == pr and r.get("release") == release and "without" in r
                          and r["without"].get("pytest")), None)
            # the other entries whose bug this PR fixes with this one's: citing it, affected on the release, and
            # measured fixed from the same release on
            also = tuple(other.id for other in fixes.all_fixes()
                         if other.id != fix.id and pr in other.info.upstream_prs
                         and other.info.expected_affected(release) and other.info.sweep
                         and other.info.sweep.first_fixed == fix.info.sweep.first_fixed)
            wanted = {fix.id, *also}
            known_with = None if force else next((ReleaseRun(**r["with"]) for r in data["entries"].values()
                               if r.get("pr") == pr and r.get("release") == release and "with" in r
                               and set(fix_ids(r["with"].get("applied", ""))) == wanted), None)
            try:
                result = machine.with_fix(row, fix.id, release, known, also=also, known_with=known_with)
            except TriageError as exc:
                result = {"entry": fix.id, "pr": pr, "release": release, "state": COULD_NOT_RUN, "reason": str(exc),
                          "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}
            data["entries"][key] = result
            save(data, entries=[key])
            print(f"{fix.id} (PR #{pr}) on {release}: {result.get('verdict') or result.get('state')}", flush=True)
    return 0

