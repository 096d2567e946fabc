from pathlib import Path

from ci.tools import imports


def test_when_reading_the_package_then_no_layering_problem_and_no_circle():
    graph = imports.build()
    assert imports.violations(graph) == []
    assert any(m.startswith("fixes.entries.") for m in graph.modules)  # the graph saw the entries


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_when_the_harness_imports_an_entry_then_reported_with_the_circle(tmp_path):
    root = _tree(tmp_path, {
        "fixes/__init__.py": "", "fixes/fix.py": "", "fixes/entries/__init__.py": "",
        "fixes/harness/__init__.py": "", "fixes/harness/training.py": "def f():\n    from ..entries.a import helper\n",
        "fixes/entries/a/__init__.py": "from ...fix import Fix\nFIX = 1\ndef helper():\n    from ...harness import training\n",
        "fixes/entries/b/__init__.py": "from ..a import helper\nFIX = 2\n",
    })
    problems = imports.violations(imports.build(root))
    assert "harness fixes.harness.training imports entry fixes.entries.a" in problems
    assert any(p.startswith("fix-side fixes.entries.a ") and p.endswith("imports fixes.harness.training") for p in problems)
    assert any("entry b" in p and "another entry" in p for p in problems)
    assert any(p.startswith("circle:") and "fixes.harness.training" in p for p in problems)


def test_when_an_entry_reproduction_imports_the_harness_then_that_is_allowed(tmp_path):
    root = _tree(tmp_path, {
        "fixes/__init__.py": "", "fixes/fix.py": "", "fixes/entries/__init__.py": "",
        "fixes/harness/__init__.py": "from ..fix import x\n",
        "fixes/entries/a/__init__.py": "from ...fix import Fix\nFIX = 1\n",
        "fixes/entries/a/reproduce.py": "from ...harness import y\nfrom . import FIX\n",
    })
    assert imports.violations(imports.build(root)) == []
