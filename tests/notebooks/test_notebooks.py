"""Every entry's notebook, executed through the papermill runner on its matrix: on its
reproduce release the bug must show and the fix must verify; on a release measured unaffected
the notebook must find nothing to fix and the same checks must hold."""
import nbformat
import pytest

import fixes
from ci import runner

PAIRS = runner.matrix()


@pytest.mark.notebooks
@pytest.mark.parametrize(("entry", "release"), PAIRS, ids=[f"{e}@{r}" for e, r in PAIRS])
def test_when_notebook_runs_on_its_matrix_then_it_reproduces_fixes_and_verifies(entry, release, matrix_build):
    _, results = matrix_build
    result = results[entry, release]
    assert result.status == "passed", f"{result.notebook} failed at cell {result.failed_cell}: {result.error}"
    record = result.record
    expected = fixes.get(entry).info.expected_affected(release)
    assert record["affected"] is expected
    assert record["verified"] and all(check["close"] for check in record["verified"])
    if expected:
        assert record["reproduced"] is not None
        assert record["fix_action"] == "applied"
    else:
        assert record["reproduced"] is None
        assert record["fix_action"] == "not needed"


@pytest.mark.parametrize("entry", fixes.available())
def test_when_notebook_is_stored_then_it_is_clean_and_has_its_sections(entry):
    notebook = nbformat.read(runner.notebook_path(entry), as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "stored with outputs"
    tags = [tag for cell in notebook.cells for tag in cell.get("metadata", {}).get("tags", [])]
    assert "parameters" in tags and "colab-setup" in tags
    headings = {line[3:].strip() for cell in notebook.cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if line.startswith("## ")}
    assert {"Symptom", "Environment", "Reproduce", "Root cause", "Fix", "Verify"} <= headings
