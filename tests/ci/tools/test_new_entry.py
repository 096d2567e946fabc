import importlib.util
import sys

import nbformat
import pytest

from ci.tools import new_entry


def test_when_scaffolding_then_the_six_files_are_written_and_the_fix_loads(tmp_path, monkeypatch):
    written = new_entry.scaffold("demo-bug", "0.18.9", "Demo bug title", ["ZeRO-1/2"], root=tmp_path)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in written.values()) == [
        "fixes/entries/demo_bug/__init__.py", "fixes/entries/demo_bug/info.toml", "fixes/entries/demo_bug/reproduce.py",
        "fixes/entries/demo_bug/trigger.py", "notebooks/demo-bug.ipynb", "tests/fixes/entries/demo_bug/test_fix.py"]
    on_disk = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert on_disk == sorted(p.relative_to(tmp_path).as_posix() for p in written.values()), "wrote something else"
    assert {p.parent for p in written.values()} == set(new_entry.folders("demo-bug", tmp_path))
    spec = importlib.util.spec_from_file_location("fixes.entries.demo_bug", written["fix"],
                                                  submodule_search_locations=[str(written["fix"].parent)])
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # as an import does: the class finds its info.toml beside it
    spec.loader.exec_module(module)
    assert module.FIX.id == "demo-bug" and module.FIX.info.reproduce_release == "0.18.9"
    assert module.FIX.info.components == ("ZeRO-1/2",) and module.FIX.info.title == "Demo bug title"
    with pytest.raises(NotImplementedError, match="TODO"):
        module.FIX.read_code()
    compile(written["reproduce"].read_text(), "reproduce.py", "exec")
    assert "TRIGGER = None" in written["trigger"].read_text()  # the contract's trigger check fails until it is stated
    test = written["test"].read_text()
    compile(test, "test_fix.py", "exec")
    assert "assert_apply_is_idempotent" not in test and "raise AssertionError(\"TODO" in test  # the contract's job


def test_when_scaffolded_notebook_is_read_then_it_has_the_shape_the_notebook_tests_require(tmp_path):
    written = new_entry.scaffold("demo-bug", "0.18.9", "Demo bug title", ["ZeRO-1/2"], root=tmp_path)
    notebook = nbformat.read(written["notebook"], as_version=4)
    assert notebook.cells[0].source == "# Demo bug title"
    tags = [tag for cell in notebook.cells for tag in cell.get("metadata", {}).get("tags", [])]
    assert {"parameters", "colab-setup", "entry-card"} <= set(tags)
    headings = {line[3:] for c in notebook.cells if c.cell_type == "markdown" for line in c.source.splitlines()
                if line.startswith("## ")}
    assert {"Symptom", "Environment", "Reproduce", "Root cause", "Fix", "Verify"} <= headings
    assert any("raise AssertionError(\"TODO" in c.source for c in notebook.cells if c.cell_type == "code"), \
        "an unfilled notebook must fail when run"


def test_when_entry_exists_or_slug_is_bad_then_nothing_is_written(tmp_path):
    new_entry.scaffold("demo-bug", "0.18.9", "t", ["c"], root=tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    with pytest.raises(FileExistsError, match="already has"):
        new_entry.scaffold("demo-bug", "0.18.9", "t", ["c"], root=tmp_path)
    with pytest.raises(ValueError, match="not a slug"):
        new_entry.scaffold("Demo_Bug", "0.18.9", "t", ["c"], root=tmp_path)
    assert sorted(p for p in tmp_path.rglob("*")) == before
