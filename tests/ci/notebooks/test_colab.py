import json
import shutil
import subprocess
from pathlib import Path

import nbformat
import pytest

from ci.notebooks import colab, runner


def test_when_notebooks_are_checked_then_every_colab_cell_matches_mkdocs_repo_url_and_release():
    assert colab.main(["check"]) == 0, "run `python -m ci.notebooks.colab sync`"


def test_when_colab_cell_is_rendered_then_it_installs_the_entry_release_only_on_colab():
    source = colab.setup_source("zero3-linear-setup-context", "https://github.com/o/r")
    assert '"google.colab" in sys.modules' in source
    assert "deepspeed==0.18.9" in source and "deepspeed-fixbook @ git+https://github.com/o/r" in source


def test_when_colab_cell_is_executed_outside_colab_then_it_does_nothing():
    namespace: dict = {}
    exec(colab.setup_source("zero3-linear-setup-context", "https://github.com/o/r"), namespace)
    assert "subprocess" not in namespace


def test_when_repo_url_changes_then_sync_rewrites_the_cell(tmp_path):
    path = tmp_path / "zero3-linear-setup-context.ipynb"
    shutil.copy(runner.notebook_path("zero3-linear-setup-context"), path)
    assert colab.out_of_date(path, "https://github.com/other/repo")
    assert colab.sync(path, "https://github.com/other/repo")
    assert not colab.out_of_date(path, "https://github.com/other/repo")
    assert not colab.sync(path, "https://github.com/other/repo")
    cells = nbformat.read(path, as_version=4).cells
    assert sum(colab.TAG in c.metadata.get("tags", []) for c in cells) == 1


def test_when_badge_url_is_built_then_it_points_at_the_notebook_on_colab():
    assert colab.colab_url("x", "https://github.com/o/r") == (
        "https://colab.research.google.com/github/o/r/blob/main/notebooks/x.ipynb")


@pytest.mark.notebooks
def test_when_setup_cell_runs_in_a_fresh_colab_runtime_then_it_installs_both_and_the_notebook_passes(tmp_path, monkeypatch):
    """The set-up cell the way Colab runs it: in a runtime with neither DeepSpeed nor ``fixes``, it pip-installs
    the entry's release from PyPI and the Fixbook from this checkout (its committed HEAD), into the kernel."""
    import fixes
    from fixes.record import RunRecord

    entry = "zero-grad-hook-lifetime"  # a short notebook; the cell is the same in every notebook but the release
    release = fixes.get(entry).info.reproduce_release
    runtime = tmp_path / "runtime"
    colab.fresh_runtime(runtime)
    bare = subprocess.run([str(runtime / "bin" / "python"), "-c", "import deepspeed"], capture_output=True, text=True)
    assert "No module named 'deepspeed'" in bare.stderr, "the fresh runtime already has a DeepSpeed"
    notebook = tmp_path / f"{entry}.ipynb"
    shutil.copy(runner.notebook_path(entry), notebook)
    assert colab.sync(notebook, colab.local_url())  # GitHub -> this checkout, nothing else changes
    monkeypatch.setenv("JUPYTER_PATH", str(runtime / "share" / "jupyter"))
    monkeypatch.delenv("PYTHONPATH", raising=False)  # the kernel imports what the cell installed, nothing else
    home = tmp_path / "content"  # Colab's working directory: not this checkout, whose fixes/ would shadow the install
    home.mkdir()
    record_path = tmp_path / "record.json"
    result = runner.execute(notebook, tmp_path / "executed.ipynb", colab.RUNTIME_KERNEL, {"results_file": str(record_path)},
                            cell_timeout=600, entry=entry, release=release, cwd=home)
    assert result.status == "passed", f"failed at cell {result.failed_cell}: {result.error} ({result.executed})"
    record = RunRecord.from_json(json.loads(record_path.read_text()))
    installed = Path(record.environment["deepspeed_path"])
    assert record.environment["deepspeed"] == release and installed.is_relative_to(runtime), record.environment
    assert Path(record.environment["fixes_path"]).is_relative_to(runtime), record.environment
    assert record.verdict == "reproduced → fixed", record
