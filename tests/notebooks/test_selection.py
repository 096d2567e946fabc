"""Which notebook runs a test session executes, and how many at once (tests/conftest.py runs_needed, matrix_jobs)."""
from types import SimpleNamespace

from tests.conftest import matrix_jobs, runs_needed

MATRIX = [("a", "0.18.9", "cpu"), ("a", "0.19.8", "cpu"), ("b", "0.18.9", "cpu")]


def _item(params=None, one_run=False, fixtures=("matrix_build",)):
    return SimpleNamespace(fixturenames=fixtures, callspec=SimpleNamespace(params=params) if params else None,
                           get_closest_marker=lambda name: name if (one_run and name == "one_run") else None)


def test_when_one_entry_s_notebook_tests_are_selected_then_only_its_runs_execute():
    items = [_item({"entry": "a", "release": r, "environment": "cpu"}) for r in ("0.19.8", "0.18.9")]
    assert runs_needed(items + [_item(fixtures=("tmp_path",))], MATRIX) == MATRIX[:2]


def test_when_a_site_test_is_selected_then_every_run_executes():
    items = [_item({"entry": "b", "release": "0.18.9", "environment": "cpu"}), _item()]
    assert runs_needed(items, MATRIX) == MATRIX


def test_when_only_a_one_run_test_is_selected_then_one_run_executes():
    assert runs_needed([_item(one_run=True)], MATRIX) == MATRIX[:1]
    assert runs_needed([_item({"entry": "b", "release": "0.18.9", "environment": "cpu"}), _item(one_run=True)],
                       MATRIX) == MATRIX[2:]


def test_when_no_test_uses_the_matrix_then_nothing_executes():
    assert runs_needed([_item(fixtures=("tmp_path",))], MATRIX) == []


def test_when_every_xdist_worker_takes_part_in_the_matrix_then_each_runs_its_share_of_the_cores(monkeypatch):
    monkeypatch.delenv("FIXBOOK_JOBS", raising=False)
    assert matrix_jobs(cpus=2, workers=2) == 1
    assert matrix_jobs(cpus=2, workers=1) == 2  # -n 0: the matrix has the machine
    assert matrix_jobs(cpus=8, workers=2) == 4
    assert matrix_jobs(cpus=2, workers=4) == 1  # never fewer than one
    monkeypatch.setenv("FIXBOOK_JOBS", "3")
    assert matrix_jobs(cpus=2, workers=2) == 3
