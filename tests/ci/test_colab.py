import shutil

import nbformat

from ci import colab, runner


def test_when_notebooks_are_checked_then_every_colab_cell_matches_mkdocs_repo_url_and_release():
    assert colab.main(["check"]) == 0, "run `python -m ci.colab sync`"


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
