"""ci.site.notebook_pages: the entry pages converted before mkdocs runs, into mkdocs-jupyter's own cache."""
import subprocess
import sys

import nbformat
import pytest

from ci.site import notebook_pages

MKDOCS_YML = """site_name: pages
docs_dir: docs
plugins:
  - mkdocs-jupyter:
      include: ["generated/entries/*.ipynb"]
      execute: false
      include_source: true
nav:
  - Home: index.md
"""


def _project(tmp_path):
    tmp_path.mkdir()
    (tmp_path / "mkdocs.yml").write_text(MKDOCS_YML)
    entries = tmp_path / "docs" / "generated" / "entries"
    entries.mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text("# Home\n")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# An entry\n\n## Symptom\n\ntext"),
                nbformat.v4.new_code_cell("print(6 * 7)", outputs=[nbformat.v4.new_output("stream", text="42\n")])]
    nbformat.write(nb, entries / "an-entry.ipynb")
    (tmp_path / "docs" / "other.ipynb").write_text((entries / "an-entry.ipynb").read_text())  # not included
    return tmp_path / "mkdocs.yml"


def _build(project, site):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-v", "-d", str(site)], cwd=project,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stderr + done.stdout


def test_when_pages_are_converted_first_then_mkdocs_reads_each_from_its_cache_and_builds_the_same_site(tmp_path):
    import shutil

    project = _project(tmp_path / "project")
    docs, config = notebook_pages.plugin_config(project)
    assert [p.name for p in notebook_pages.notebook_pages(docs, config)] == ["an-entry.ipynb"]
    plain = _build(project.parent, tmp_path / "plain")  # mkdocs converts the page itself, and caches it
    assert "Cache miss" in plain
    shutil.rmtree(project.parent / ".cache")
    assert notebook_pages.convert_all(project, jobs=1) == notebook_pages.Converted(1, 0, 1)
    assert notebook_pages.convert_all(project, jobs=2) == notebook_pages.Converted(0, 1, 2)
    cached = _build(project.parent, tmp_path / "cached")
    assert "Cache hit" in cached and "Cache miss" not in cached
    page = "generated/entries/an-entry/index.html"
    assert (tmp_path / "cached" / page).read_text() == (tmp_path / "plain" / page).read_text()
    assert "42" in (tmp_path / "cached" / page).read_text()


def test_when_the_site_uses_no_notebook_plugin_then_it_is_a_clear_error(tmp_path):
    (tmp_path / "mkdocs.yml").write_text("site_name: x\nplugins:\n  - search\n")
    with pytest.raises(RuntimeError, match="uses no mkdocs-jupyter plugin"):
        notebook_pages.plugin_config(tmp_path / "mkdocs.yml")


def test_when_a_second_exporter_renders_then_it_compiles_no_template_again_and_renders_the_same(monkeypatch):
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    notebook_pages.keep_compiled_templates()
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A page"),
                                               nbformat.v4.new_code_cell("1 + 1")])
    first, _ = HTMLExporter().from_notebook_node(notebook)
    compiled = []
    original = jinja2.Environment._compile

    def counting(self, source, filename):
        compiled.append(filename)
        return original(self, source, filename)

    monkeypatch.setattr(jinja2.Environment, "_compile", counting)
    second, _ = HTMLExporter().from_notebook_node(notebook)
    assert second == first and compiled == []


def test_when_the_site_is_built_in_this_process_then_it_is_the_mkdocs_command_s_site(tmp_path):
    project = _project(tmp_path / "project")
    _build(project.parent, tmp_path / "command")
    waiting = notebook_pages.start_converting(project, jobs=2)
    assert waiting() == notebook_pages.Converted(0, 1, 2)  # the command's build cached the page
    notebook_pages.mkdocs_build(project)
    page = "generated/entries/an-entry/index.html"
    assert (project.parent / "site" / page).read_text() == (tmp_path / "command" / page).read_text()


def test_when_a_strict_build_warns_then_the_in_process_build_is_a_clear_error(tmp_path):
    project = _project(tmp_path / "project")
    (project.parent / "docs" / "index.md").write_text("# Home\n\n[gone](missing.md)\n")
    with pytest.raises(RuntimeError, match="mkdocs build --strict: Aborted with 1 warnings in strict mode"):
        notebook_pages.mkdocs_build(project)
