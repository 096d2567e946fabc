import os
from pathlib import Path

import pytest

from ci import runner
from tests.helpers import made_once

RUN_PARAMS = ("entry", "release", "environment")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that uses the matrix's notebook runs (``matrix_build``, directly or through another fixture such as
    the built site) is a ``notebooks`` test: ``-m "not notebooks"`` leaves it out, ``-m notebooks`` selects it."""
    for item in items:
        if "matrix_build" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.notebooks)
    items[:] = matrix_first(items)


def matrix_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """One notebook test first, so that the matrix (the longest part) starts at once on the worker that gets it;
    then every test that needs no notebook run, which the other pytest-xdist worker runs meanwhile (xdist first hands
    each worker a chunk of consecutive tests); then the other notebook tests, once the matrix is there. The
    order within each part is kept."""
    uses = [item for item in items if "matrix_build" in getattr(item, "fixturenames", ())]
    others = [item for item in items if "matrix_build" not in getattr(item, "fixturenames", ())]
    return uses[:1] + others + uses[1:]


def runs_needed(items: list[pytest.Item], matrix: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """The matrix runs the selected tests use: each notebook test's own (entry, release, environment);
    a test of one run, whichever (``one_run``), the first; any other user (the site) every run. So
    ``pytest tests/notebooks -k my-bug`` executes my-bug's notebooks only."""
    wanted: set[tuple[str, str, str]] = set()
    any_one = False
    for item in items:
        if "matrix_build" not in getattr(item, "fixturenames", ()):
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if all(name in params for name in RUN_PARAMS):
            wanted.add(tuple(params[name] for name in RUN_PARAMS))
        elif item.get_closest_marker("one_run"):
            any_one = True
        else:
            return list(matrix)
    if any_one and not wanted:
        wanted.add(matrix[0])
    return [run for run in matrix if run in wanted]


def matrix_jobs(cpus: int | None = None, workers: int | None = None) -> int:
    """How many notebooks the matrix runs at once: ``FIXBOOK_JOBS`` if set, else one per core that the other
    pytest-xdist workers leave (each of them runs tests meanwhile), at least one. On a 2-core machine with the two
    workers of ``pyproject.toml``, one at a time: two at once beside the other worker's tests only made the whole
    run slower (the matrix took as long, the other worker's tests longer). Alone (``-n 0``, or ``python -m
    ci.runner --jobs 2``) two at once is the faster (``python -m ci.bench --section notebooks``).
    """
    if os.environ.get("FIXBOOK_JOBS"):
        return int(os.environ["FIXBOOK_JOBS"])
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if workers is None else workers
    return max(1, cpus - (workers - 1))


@pytest.fixture(scope="session")
def matrix_build(request, tmp_path_factory):
    """The notebooks executed once each on the matrix runs the session's tests use (:func:`runs_needed`),
    into a temporary build directory, once per test run (:func:`tests.helpers.made_once`: one pytest-xdist worker
    runs them, the other waits); shared by the notebook tests and the site tests. As many notebooks run at once
    as there are cores the other pytest-xdist workers leave (:func:`matrix_jobs`; ``FIXBOOK_JOBS`` overrides).

    With ``FIXBOOK_BUILD=DIR`` the runs are read from ``DIR`` instead (a build the runner made already, e.g. the
    merged shards of CI's notebook matrix, ``python -m ci.runner --merge``); a run the tests need that it lacks
    is an error."""
    runs = runs_needed(request.session.items, runner.matrix())
    if os.environ.get("FIXBOOK_BUILD"):
        build = Path(os.environ["FIXBOOK_BUILD"]).resolve()
        made = {(r.entry, r.release, r.environment): r for r in runner.recorded_runs(build)}
        missing = [run for run in runs if run not in made]
        if missing:
            raise RuntimeError(f"FIXBOOK_BUILD={build} holds no run of {len(missing)} of the {len(runs)} runs these tests "
                               f"use, e.g. {', '.join('@'.join(run) for run in missing[:3])}: run or merge them there")
        return build, {run: made[run] for run in runs}

    def run(directory: Path) -> tuple[Path, dict]:
        results = runner.run_matrix(runs, cell_timeout=300, build=directory, jobs=matrix_jobs())
        return directory, {(r.entry, r.release, r.environment): r for r in results}

    return made_once(tmp_path_factory, "build", run)
