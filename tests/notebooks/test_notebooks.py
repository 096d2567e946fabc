"""Every entry's notebook, executed through the papermill runner: on its reproduce release the bug must show and the
fix must verify; on a release measured unaffected the notebook must find nothing to fix and the same checks must hold.
These are ``notebooks`` tests, which the default ``pytest`` leaves out: ``pytest -m notebooks`` runs them, on the runs of
``FIXBOOK_BUILD`` (the main job's build with ``FIXBOOK_MATRIX=main``, CI's merged build) or executing them itself."""
import json
import re
from pathlib import Path

import nbformat
import pytest

import fixes
from ci.notebooks import claims, runner
from fixes import measured

RUNS = runner.tests_matrix()  # every run; FIXBOOK_MATRIX=main: the main job's


def expected_affected(entry: str, release: str, environment: str) -> bool | None:
    """What the sweep measured for this run: the environment's own rows where it has them (torch-2.0),
    else the project venv's (colab-shape runs the same code paths on a newer torch)."""
    rows = measured.load().environment(environment) if environment != "cpu" else None
    if rows is not None and rows.entry(entry).get(release) is not None:
        return rows.entry(entry).expected_affected(release)
    return fixes.get(entry).info.expected_affected(release)


@pytest.mark.notebooks
@pytest.mark.parametrize(("entry", "release", "environment"), RUNS, ids=[f"{e}@{r}-{v}" for e, r, v in RUNS])
def test_when_notebook_runs_on_its_matrix_then_it_reproduces_fixes_and_verifies(entry, release, environment, matrix_build):
    _, results = matrix_build
    result = results[entry, release, environment]
    assert result.status == "passed", f"{result.notebook} ({environment}) failed at cell {result.failed_cell}: {result.error}"
    record = result.record
    assert record is not None, "the notebook wrote no record"
    expected = expected_affected(entry, release, environment)
    assert record.affected is expected
    assert record.verified and all(check.close for check in record.verified)
    if expected:
        assert record.reproduced is not None
        assert record.fix_action == "applied"
        assert result.verdict == "reproduced → fixed"
    else:
        assert record.reproduced is None
        assert record.fix_action == "not needed"
        assert result.verdict == "not affected"


@pytest.mark.notebooks
@pytest.mark.parametrize(("entry", "release", "environment"), RUNS, ids=[f"{e}@{r}-{v}" for e, r, v in RUNS])
def test_when_notebook_runs_on_its_matrix_then_its_claim_cells_show_what_the_reference_shows(entry, release, environment,
                                                                                           matrix_build):
    """nbval's comparison of the cells tagged nbval-check-output, on the run above (no second run)."""
    _, results = matrix_build
    result = results[entry, release, environment]
    assert result.status == "passed", f"no claims to check: the notebook failed at cell {result.failed_cell}"
    mismatches = claims.check(entry, release, environment, Path(result.executed))
    assert not mismatches, "\n\n".join(str(m) for m in mismatches)


@pytest.mark.notebooks
@pytest.mark.one_run
def test_when_a_claim_is_changed_in_a_copy_of_the_reference_then_the_real_run_fails_the_check(matrix_build, tmp_path):
    (entry, release, environment), result = next(iter(matrix_build[1].items()))
    reference = json.loads(claims.reference_path(entry).read_text())
    run = reference[claims.run_key(release, environment)]
    cell_id, claim = next((cell_id, claim) for cell_id, claim in run.items() if claim["shown"].get("stdout"))
    claim["shown"]["stdout"][0].append("a line the run never printed\n")
    claims.reference_path(entry, tmp_path).write_text(json.dumps(reference))
    [mismatch] = claims.check(entry, release, environment, Path(result.executed), root=tmp_path)
    assert mismatch.cell.startswith("cell ") and f"(id {cell_id})" in mismatch.cell
    assert "+a line the run never printed" not in str(mismatch) and "-a line the run never printed" in str(mismatch)


@pytest.mark.parametrize("entry", fixes.available())
def test_when_notebook_is_stored_then_it_is_clean_and_has_its_sections(entry):
    notebook = nbformat.read(runner.notebook_path(entry), as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "stored with outputs"
    tags = [tag for cell in notebook.cells for tag in cell.get("metadata", {}).get("tags", [])]
    assert "parameters" in tags and "colab-setup" in tags
    headings = {line[3:].strip() for cell in notebook.cells if cell.cell_type == "markdown"
                for line in cell.source.splitlines() if line.startswith("## ")}
    assert {"Symptom", "Environment", "Reproduce", "Root cause", "Fix", "Verify"} <= headings


# What a notebook's prose may not state, because the card (FixInfo, the sweep, the run history) does:
# an affected range, a measured count, the GPU status.
RANGE = re.compile(r"\b(before|after|since|until|up to|through|from)\s+(DeepSpeed\s+)?`?0\.\d+\.\d+"
                   r"|0\.\d+\.\d+`?\s*(–|-|to|through)\s*`?0\.\d+\.\d+|0\.\d+\.\d+`?\s+(and later|onwards|on\b)"
                   r"|0\.\d+\.\d+\+", re.IGNORECASE)
COUNT = re.compile(r"\b\d+ (of|out of) \d+\b")
GPU_STATUS = re.compile(r"CUDA path is\s+unverified|no GPU was available|verified on (a )?GPU", re.IGNORECASE)


@pytest.mark.parametrize("entry", fixes.available())
def test_when_notebook_is_stored_then_it_renders_its_card_and_restates_no_measured_fact(entry):
    info = fixes.get(entry).info
    notebook = nbformat.read(runner.notebook_path(entry), as_version=4)
    assert notebook.cells[0].cell_type == "markdown" and notebook.cells[0].source.strip() == f"# {info.title}", \
        "the first cell is the title, exactly FixInfo.title"
    cards = [c for c in notebook.cells if "entry-card" in c.get("metadata", {}).get("tags", [])]
    assert len(cards) == 1 and f'fixes.card.show("{entry}")' in cards[0].source, "one entry-card cell, for this entry"
    for cell in notebook.cells:
        if cell.cell_type != "markdown":
            continue
        prose = re.sub(r"```.*?```", "", cell.source, flags=re.DOTALL)  # quoted DeepSpeed code may hold anything
        for pattern, what in ((RANGE, "an affected range"), (COUNT, "a measured count"), (GPU_STATUS, "the GPU status")):
            found = pattern.search(prose)
            assert found is None, f"markdown states {what} ({found.group(0)!r}): print it from the record instead"


@pytest.mark.parametrize("entry", fixes.available())
def test_when_entry_metadata_is_read_then_title_and_summary_state_no_range(entry):
    info = fixes.get(entry).info
    for name in ("title", "summary", "root_cause"):
        text = getattr(info, name)
        found = RANGE.search(text) or COUNT.search(text)
        assert found is None, f"FixInfo.{name} states {found.group(0)!r}: ranges and counts come from the sweep"
