"""Every entry's notebook, executed through the papermill runner on its matrix: on its
reproduce release the bug must show and the fix must verify; on a release measured unaffected
the notebook must find nothing to fix and the same checks must hold."""
import pytest

import fixes
from ci import runner

PAIRS = runner.matrix()


@pytest.mark.notebooks
@pytest.mark.parametrize(("entry", "release"), PAIRS, ids=[f"{e}@{r}" for e, r in PAIRS])
def test_when_notebook_runs_on_its_matrix_then_it_reproduces_fixes_and_verifies(entry, release, tmp_path):
    result = runner.run_one(entry, release, cell_timeout=300, build=tmp_path)
    assert result.status == "passed", f"{result.notebook} failed at cell {result.failed_cell}: {result.error}"
    record = result.record
    info = fixes.get(entry).info
    expected = info.expected_affected(release)
    assert record["affected"] is expected
    assert record["verified"] and all(check["close"] for check in record["verified"])
    if expected:
        assert record["reproduced"] is not None
        assert record["fix_action"] == "applied"
    else:
        assert record["reproduced"] is None
        assert record["fix_action"] == "not needed"
