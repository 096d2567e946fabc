"""Attribution of the differential record's differing/crashing rows: the rule (trigger holds, measured range holds
the release, the re-run with the fixes agrees; else flaky or unexplained), the cell's job, and the record's keeping."""
from __future__ import annotations

import pytest

from ci import differential
from ci.differential import attribute
from ci.differential import record as record_module

CELL = {"zero_stage": 0, "precision": "fp16-static", "gradient_accumulation_steps": 1, "world_size": 1}
DIFFERS = {"verdict": "differs", "max_diff": 0.7, "first_step": 0, "quantity": "parameters"}
AGREES = {"verdict": "agrees", "max_diff": 1e-8}


def entry(entry_id: str, affected: tuple[str, ...], triggered: bool | None = True) -> attribute.Entry:
    return attribute.Entry(entry_id, lambda job: triggered, lambda release: release in affected)


def test_when_the_trigger_holds_and_the_range_holds_the_release_then_the_entry_is_a_candidate():
    found = attribute.candidates(CELL, "0.18.2", [entry("a", ("0.18.2",)), entry("b", ("0.19.8",)),
                                                  entry("c", ("0.18.2",), triggered=False),
                                                  entry("d", ("0.18.2",), triggered=None)])
    assert found == ["a"]


def test_when_the_entrys_range_does_not_hold_the_release_then_the_row_is_not_explained():
    tried = attribute.candidates(CELL, "0.19.8", [entry("a", ("0.18.2",))])
    assert tried == []
    assert attribute.decide(DIFFERS, tried, None, DIFFERS)["status"] == "unexplained"


def test_when_the_fix_does_not_make_the_cell_agree_then_it_is_no_explanation():
    found = attribute.decide(DIFFERS, ["a"], {**DIFFERS, "applied": ["a: applied"]}, DIFFERS)
    assert found["status"] == "unexplained" and found["entries"] == [] and found["tried"] == ["a"]
    assert found["minimised"] == attribute.NOT_MINIMISED


def test_when_the_fix_makes_the_cell_agree_then_the_row_is_explained_by_the_applied_entries():
    found = attribute.decide(DIFFERS, ["a", "b"], AGREES, None)
    assert found == {"status": "explained", "entries": ["a", "b"], "with_fixes": AGREES}


def test_when_a_difference_does_not_show_twice_then_the_row_is_flaky_with_both_values():
    found = attribute.decide(DIFFERS, [], None, AGREES)
    assert found["status"] == "flaky" and found["again"] == AGREES


def test_when_a_crash_does_not_repeat_then_it_is_still_not_flaky():
    found = attribute.decide({"verdict": "crashes", "error": "boom"}, [], None, AGREES)
    assert found["status"] == "unexplained"


def test_when_an_agreeing_row_is_given_then_decide_refuses():
    with pytest.raises(ValueError, match="attributed"):
        attribute.decide(AGREES, [], None, None)


def test_when_a_cell_calls_loss_backward_with_two_groups_then_its_job_states_those_uses():
    job = attribute.cell_job({**CELL, "backward": "tensor", "param_groups": 2, "world_size": 2})
    assert {"direct-backward", "param-groups", "param-group-lrs"} <= set(job.uses)
    assert job.zero_stage == 0 and job.precision == "fp16" and job.world_size == 2


def test_when_a_cpu_only_entry_is_read_then_it_is_a_candidate_for_a_cell_the_sweep_ran_on_cpu():
    from fixes import measured

    cell = {**CELL, "zero_stage": 2, "precision": "fp32", "world_size": 2, "contiguous_gradients": False}
    assert attribute.cell_job(cell).accelerator == "cpu"
    affected = measured.for_entry("zero12-cpu-no-allreduce-noncontiguous").affected
    assert "zero12-cpu-no-allreduce-noncontiguous" in attribute.candidates(cell, affected[0], attribute.book_entries())


def test_when_a_cell_resumes_from_a_universal_checkpoint_then_its_job_loads_it_universally():
    from fixes import measured

    cell = {**CELL, "precision": "fp32", "zero_stage": 3, "sub_group_size": 64, "checkpoint": "universal"}
    assert attribute.cell_job(cell).load_universal and not attribute.cell_job({**cell, "checkpoint": "none"}).load_universal
    affected = measured.for_entry("zero3-universal-resume-shared-adam-step").affected
    assert "zero3-universal-resume-shared-adam-step" in attribute.candidates(cell, affected[-1],
                                                                             attribute.book_entries())


def test_when_the_book_is_read_then_fp16_zero0_is_a_candidate_for_an_fp16_zero0_cell_on_its_range():
    from fixes import measured

    affected = measured.for_entry("fp16-zero0-loss-scale").affected
    assert affected, "fp16-zero0-loss-scale has affected releases in the sweep"
    assert "fp16-zero0-loss-scale" in attribute.candidates(CELL, affected[0], attribute.book_entries())
    unaffected = measured.for_entry("fp16-zero0-loss-scale").unaffected
    if unaffected:
        assert "fp16-zero0-loss-scale" not in attribute.candidates(CELL, unaffected[-1], attribute.book_entries())


def test_when_a_row_is_measured_again_then_its_attribution_is_dropped_and_others_kept():
    old = record_module.Record(cells={"x": {"cell": CELL}, "y": {"cell": CELL}},
                               rows={"x": {"0.18.2": DIFFERS}, "y": {"0.18.2": DIFFERS}}, releases=["0.18.2"],
                               attribution={"x": {"0.18.2": {"status": "flaky"}}, "y": {"0.18.2": {"status": "flaky"}}})
    merged = record_module.merge(old, {}, {("x", "0.18.2"): AGREES})
    assert merged.attributed("x", "0.18.2") is None and merged.attributed("y", "0.18.2") == {"status": "flaky"}


def test_when_the_record_round_trips_then_the_attribution_is_kept(tmp_path):
    data = record_module.Record(cells={"x": {"cell": CELL}}, rows={"x": {"0.18.2": DIFFERS}}, releases=["0.18.2"],
                                attribution={"x": {"0.18.2": {"status": "explained", "entries": ["a"]}}})
    record_module.write(data, tmp_path / "r.json")
    assert record_module.read(tmp_path / "r.json").attribution == data.attribution


def test_when_rows_are_attributed_then_the_summary_counts_them_by_entry_and_status():
    data = record_module.Record(cells={"x": {"cell": CELL}, "y": {"cell": CELL}},
                                rows={"x": {"0.18.2": DIFFERS}, "y": {"0.18.2": DIFFERS}}, releases=["0.18.2"],
                                attribution={"x": {"0.18.2": {"status": "explained", "entries": ["a"]}}})
    text = "\n".join(differential.attribution_summary(data))
    assert "0.18.2: 1 explained, 0 unexplained, 0 flaky" in text
    assert "explained by a: 1 rows" in text and "rows not attributed yet: 1" in text


def test_when_one_of_several_fixes_alone_makes_the_cell_agree_then_only_that_entry_explains_it():
    found = attribute.narrow(attribute.decide(DIFFERS, ["a", "b"], AGREES, None), {"a": DIFFERS, "b": AGREES})
    assert found["entries"] == ["b"] and found["applied_together"] == ["a", "b"]


def test_when_no_fix_alone_makes_the_cell_agree_then_the_entries_explain_it_together():
    found = attribute.narrow(attribute.decide(DIFFERS, ["a", "b"], AGREES, None), {"a": DIFFERS, "b": DIFFERS})
    assert found["entries"] == ["a", "b"] and found["together"] is True


def test_when_a_difference_does_not_show_twice_then_no_entry_is_credited_even_if_its_fix_run_agrees():
    found = attribute.decide(DIFFERS, ["a"], AGREES, AGREES)
    assert found["status"] == "flaky" and found["entries"] == [] and found["tried"] == ["a"]


def test_when_the_difference_shows_twice_and_the_fix_makes_it_agree_then_it_is_explained():
    found = attribute.decide(DIFFERS, ["a"], AGREES, DIFFERS)
    assert found["status"] == "explained" and found["entries"] == ["a"] and found["again"]["verdict"] == "differs"


def test_when_the_record_is_cross_checked_then_an_entry_shows_its_bug_only_where_its_trigger_cell_failed_for_it():
    from ci.differential import design as design_module
    from ci.differential import space as space_module
    from fixes import registry

    loaded = space_module.load()
    design = design_module.build(loaded)
    entry_id = "warmup-cosine-lr-param-groups"
    release = registry.get(entry_id).info.reproduce_release
    [cell] = {design_module.cell_id(t.cell) for t in design.triggers if t.entry == entry_id and t.cell is not None
              and t.label == next(t.label for t in design.triggers if t.entry == entry_id)}
    shows = record_module.Record(cells={cell: {"cell": {}}}, rows={cell: {release: DIFFERS}},
                                 attribution={cell: {release: {"status": "explained", "entries": [entry_id]}}})
    agrees = record_module.Record(cells={cell: {"cell": {}}}, rows={cell: {release: AGREES}})
    [shown] = [c for c in differential.cross_check(shows, design) if c.entry == entry_id]
    [not_shown] = [c for c in differential.cross_check(agrees, design) if c.entry == entry_id]
    assert shown.shown and f"explained by {entry_id}" in shown.why
    assert not not_shown.shown and not_shown.why == f"{cell} agrees", not_shown.why
