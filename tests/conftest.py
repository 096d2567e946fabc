import os
from pathlib import Path

import pytest

from ci.notebooks import runner
from tests.helpers import shared_directory

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
    then every test that needs no notebook run, which the other pytest-xdist worker runs meanwhile; then the other
    notebook tests, which bring that worker into the matrix once it has run out of other tests (and take none of
    its time before). The order within each part is kept."""
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
    """How many notebooks each pytest-xdist worker runs at once while it takes part in the matrix:
    ``FIXBOOK_JOBS`` if set, else its share of the cores (all workers take part once their other tests are done),
    at least one. On a 2-core machine with the two workers of ``pyproject.toml``, one each; alone (``-n 0``) two,
    the faster there (``python -m ci.bench --section notebooks``)."""
    if os.environ.get("FIXBOOK_JOBS"):
        return int(os.environ["FIXBOOK_JOBS"])
    cpus = (os.cpu_count() or 1) if cpus is None else cpus
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) if workers is None else workers
    return max(1, cpus // workers)


@pytest.fixture(scope="session")
def matrix_build(request, tmp_path_factory):
    """The notebooks executed once each on the runs the session's tests use (:func:`runs_needed`) of
    :func:`ci.notebooks.runner.tests_matrix` (every run; ``FIXBOOK_MATRIX=main``: the main job's),
    into a build directory of this test run, shared by the notebook tests and the site tests. Every
    pytest-xdist worker that needs it takes part (:func:`ci.notebooks.runner.run_matrix_together`): the first starts the
    matrix, the other joins when its own tests are done and takes runs from the other end, so neither waits
    while runs are left. :func:`matrix_jobs` notebooks at once per worker.

    With ``FIXBOOK_BUILD=DIR`` the runs are read from ``DIR`` instead (a build the runner made already, e.g. the
    merged shards of CI's notebook matrix, ``python -m ci.notebooks.runner --merge``); a run the tests need that it lacks
    is an error."""
    runs = runs_needed(request.session.items, runner.tests_matrix())
    if os.environ.get("FIXBOOK_BUILD"):
        build = Path(os.environ["FIXBOOK_BUILD"]).resolve()
        made = {(r.entry, r.release, r.environment): r for r in runner.recorded_runs(build)}
        missing = [run for run in runs if run not in made]
        if missing:
            raise RuntimeError(f"FIXBOOK_BUILD={build} holds no run of {len(missing)} of the {len(runs)} runs these tests "
                               f"use, e.g. {', '.join('@'.join(run) for run in missing[:3])}: run or merge them there")
        return build, {run: made[run] for run in runs}

    build = shared_directory(tmp_path_factory, "build")
    results = runner.run_matrix_together(runs, cell_timeout=300, build=build, jobs=matrix_jobs())
    return build, {(r.entry, r.release, r.environment): r for r in results}
