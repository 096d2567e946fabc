import json
from dataclasses import replace

from ci.sweep import restamp
from fixes import measured

CODE = '''"""The entry."""
from ...fix import Fix, FixInfo, Probe


class Bug(Fix):
    """A fix."""
    info = FixInfo(id="bug", title="t")
    targets = ()

    def read_code(self) -> Probe:
        """Read it."""
        return Probe(True, "x")  # found
'''


def test_when_only_docstrings_comments_and_the_metadata_statement_change_then_the_form_is_the_same():
    moved = CODE.replace('    info = FixInfo(id="bug", title="t")\n', "").replace("Fix, FixInfo, Probe", "Fix, Probe")
    reworded = moved.replace('"""Read it."""', '"""Read the installed code."""').replace("# found", "")
    assert restamp.module_form(CODE) == restamp.module_form(reworded)


def test_when_code_that_runs_changes_then_the_form_differs():
    assert restamp.module_form(CODE) != restamp.module_form(CODE.replace('"x"', '"y"'))
    assert restamp.module_form(CODE) != restamp.module_form(CODE.replace("targets = ()", "targets = (1,)"))
    only_docstring = CODE.replace('    """Read it."""\n', "")
    assert restamp.module_form(only_docstring) == restamp.module_form(CODE)


def test_when_forms_agree_then_the_stamps_map_and_a_changed_form_or_trigger_keeps_them_stale():
    old = {"a": {"code": "a1", "grid": "ga1", "form": "f", "trigger": "t"},
           "b": {"code": "b1", "grid": "gb1", "form": "f", "trigger": "t"},
           "c": {"code": "c1", "grid": "gc1", "form": "f", "trigger": "t"},
           "d": {"code": "d1", "grid": "gd1", "form": "f", "trigger": "t"}}
    new = {"a": {"code": "a2", "grid": "ga2", "form": "f", "trigger": "t"},  # same form: carried
           "b": {"code": "b2", "grid": "gb2", "form": "other", "trigger": "t"},  # code changed: stale
           "c": {"code": "c1", "grid": "gc2", "form": "f", "trigger": "t2"},  # trigger.py changed: grid stale
           "d": {"code": "d1", "grid": "gd1", "form": "f", "trigger": "t"},  # untouched
           "e": {"code": "e1", "grid": "ge1", "form": "f", "trigger": "t"}}  # new entry
    rows, grids, changed = restamp.plan(old, new)
    assert rows == {"a": ("a1", "a2")} and grids == {"a": ("ga1", "ga2")} and changed == ["b"]


def test_when_carried_then_only_rows_with_the_old_stamp_change_and_check_writes_nothing(tmp_path):
    def row(release, code):
        return measured.Observation(release=release, status="affected", probe=True, reproduced=True, code=code)

    sweep_path, grids_path = tmp_path / "sweep.json", tmp_path / "grids.json"
    data = measured.SweepData(releases=["0.18.2", "0.19.8"], results={"a": measured.EntrySweep("a", {
        "0.18.2": row("0.18.2", "a1"), "0.19.8": row("0.19.8", "a0")})})  # 0.19.8: measured with older code
    measured.write(data, sweep_path)
    grids_path.write_text(json.dumps({"entries": {"a": {"code": "ga1", "cells": []}}}))
    before = sweep_path.read_text(), grids_path.read_text()
    dry = restamp.carry({"a": ("a1", "a2")}, {"a": ("ga1", "ga2")}, write=False, sweep_path=sweep_path,
                        grids_path=grids_path)
    assert dry.rows == {"a": 1} and dry.grids == ["a"]
    assert (sweep_path.read_text(), grids_path.read_text()) == before
    restamp.carry({"a": ("a1", "a2")}, {"a": ("ga1", "ga2")}, write=True, sweep_path=sweep_path,
                  grids_path=grids_path)
    rows = measured.read(sweep_path).results["a"].observations
    assert rows["0.18.2"] == replace(row("0.18.2", "a1"), code="a2") and rows["0.19.8"].code == "a0"
    assert json.loads(grids_path.read_text())["entries"]["a"]["code"] == "ga2"


def test_when_this_checkout_is_read_then_each_entry_has_its_stamps_and_form():
    from ci import ROOT

    found = restamp.stamps(ROOT)
    assert found["zero12-flat-buffer-detach"]["code"] == measured.entry_code("zero12-flat-buffer-detach")
    assert all(len(stamps["form"]) == 64 for stamps in found.values())
