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


# ---- the ci packages: their order, and fixes never importing ci ------------------------------------------------

def _ci_tree(tmp_path: Path, extra: dict[str, str]) -> Path:
    """A checkout with an empty ``fixes`` and one empty module per ci package, plus ``extra``."""
    files = {"fixes/__init__.py": "", "fixes/fix.py": "", "ci/__init__.py": "ROOT = None\n"}
    for package in (*imports.CI_ORDER, *imports.CI_APART):
        files[f"ci/{package}/__init__.py"] = "from .. import ROOT\n"
    return _tree(tmp_path, {**files, **extra})


def test_when_reading_the_checkout_then_every_ci_package_is_in_the_order_and_every_ordered_one_exists():
    on_disk = {p.parent.name for p in (imports.ROOT / "ci").glob("*/__init__.py")}
    assert on_disk == set(imports.CI_ORDER) | set(imports.CI_APART)
    graph = imports.build()
    assert {graph.layer(m) for m in graph.modules if m.startswith("ci.")} == {f"ci.{p}" for p in on_disk}


def test_when_a_ci_package_imports_one_below_it_then_that_is_allowed_and_the_tools_may_import_any(tmp_path):
    root = _ci_tree(tmp_path, {
        "ci/notebooks/runner.py": "from ..releases import x\nfrom ..processes import kernels\nfrom fixes import fix\n",
        "ci/processes/kernels.py": "",
        "ci/tools/device.py": "from ..bench import y\nfrom ..notebooks import runner\n",
    })
    assert imports.violations(imports.build(root)) == []


def test_when_a_ci_package_imports_one_above_it_then_reported_naming_both(tmp_path):
    root = _ci_tree(tmp_path, {
        "ci/releases/update.py": "def f():\n    from ..sweep import plan\n",  # a lazy import counts too
        "ci/sweep/plan.py": "",
    })
    problems = imports.violations(imports.build(root))
    assert problems == [f"ci.releases (ci.releases.update) imports ci.sweep (ci.sweep.plan), above it in the order "
                        f"{' < '.join(imports.CI_ORDER)}"]


def test_when_a_ci_package_imports_the_tools_then_reported(tmp_path):
    root = _ci_tree(tmp_path, {"ci/bench/run.py": "from ci.tools import device\n", "ci/tools/device.py": ""})
    assert any(p.startswith("ci.bench (ci.bench.run) imports ci.tools") for p in imports.violations(imports.build(root)))


def test_when_ci_itself_imports_a_package_then_reported(tmp_path):
    root = _ci_tree(tmp_path, {"ci/__init__.py": "from .processes import zygote\n", "ci/processes/zygote.py": ""})
    assert any(p.startswith("ci (ci) imports ci.processes") for p in imports.violations(imports.build(root)))


def test_when_fixes_imports_ci_then_reported_even_lazily(tmp_path):
    root = _ci_tree(tmp_path, {"fixes/fix.py": "def f():\n    from ci.sweep import plan\n", "ci/sweep/plan.py": ""})
    assert imports.violations(imports.build(root)) == [
        "fixes fixes.fix imports ci.sweep.plan: the runtime package never imports ci"]


def test_when_two_ci_modules_import_each_other_then_the_circle_is_reported(tmp_path):
    root = _ci_tree(tmp_path, {"ci/sweep/a.py": "from . import b\n", "ci/sweep/b.py": "from .a import x\n"})
    assert imports.violations(imports.build(root)) == ["circle: ci.sweep.a -> ci.sweep.b -> ci.sweep.a"]


def test_when_a_ci_module_is_in_no_package_of_the_order_then_reported(tmp_path):
    root = _ci_tree(tmp_path, {"ci/helpers.py": "", "ci/misc/__init__.py": ""})
    problems = imports.violations(imports.build(root))
    assert [p.split(" is in")[0] for p in problems] == ["ci module ci.helpers", "ci module ci.misc"]
