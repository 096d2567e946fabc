"""tests/helpers.py's made_once (what several tests share is made once per test run, whichever worker asks first) and
the order conftest gives the tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import made_once


class _Factory:
    """What made_once needs of pytest's tmp_path_factory: one worker's base directory under the run's."""

    def __init__(self, run: Path, worker: str) -> None:
        self.base = run / f"popen-{worker}"
        self.base.mkdir(parents=True, exist_ok=True)

    def getbasetemp(self) -> Path:
        return self.base

    def mktemp(self, name: str) -> Path:
        path = self.base / name
        path.mkdir()
        return path


def test_when_two_workers_ask_then_the_first_makes_it_and_the_second_reads_it(tmp_path, monkeypatch):
    made = []

    def make(directory: Path) -> dict:
        made.append(directory)
        (directory / "built").write_text("x")
        return {"where": directory}

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    first = made_once(_Factory(tmp_path, "gw0"), "thing", make)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    second = made_once(_Factory(tmp_path, "gw1"), "thing", make)
    assert len(made) == 1 and first == second
    assert (second["where"] / "built").read_text() == "x"  # a directory both workers see


def test_when_making_fails_then_the_maker_raises_it_and_the_other_worker_gets_it_without_a_second_attempt(
        tmp_path, monkeypatch):
    calls = []

    def make(directory: Path) -> None:
        calls.append(directory)
        raise ValueError("the matrix could not start")

    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    with pytest.raises(ValueError, match="could not start"):
        made_once(_Factory(tmp_path, "gw0"), "thing", make)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    with pytest.raises(RuntimeError, match="another worker .* ValueError: the matrix could not start"):
        made_once(_Factory(tmp_path, "gw1"), "thing", make)
    assert len(calls) == 1


def test_when_not_under_xdist_then_it_is_made_in_a_directory_of_this_session(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    factory = _Factory(tmp_path, "main")
    assert made_once(factory, "thing", lambda directory: directory) == factory.base / "thing"


def test_when_tests_are_ordered_then_one_notebook_test_leads_the_others_wait_for_the_end_and_each_part_keeps_its_order():
    from types import SimpleNamespace

    from tests.conftest import matrix_first

    items = [SimpleNamespace(name=name, fixturenames=("matrix_build",) if name.startswith("nb") else ("tmp_path",))
             for name in ("unit1", "nb1", "unit2", "nb2", "nb3", "unit3")]
    assert [item.name for item in matrix_first(items)] == ["nb1", "unit1", "unit2", "unit3", "nb2", "nb3"]
    assert [item.name for item in matrix_first(items[:1])] == ["unit1"]
