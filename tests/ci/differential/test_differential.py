"""The differential sweep: the space, the covering design, the reference against DeepSpeed per modelled dimension,
the verdicts, and the record (round trip, merge, shards)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ci import differential
from ci.notebooks import shards
from ci.differential import design as design_module
from ci.differential import record as record_module
from ci.differential import space as space_module
from tests.helpers import call_in_release

KNOWN_RIGHT = "0.19.8"  # the newest release: no entry's range contains it for the cells the checks below run


@pytest.fixture(scope="module")
def space() -> space_module.Space:
    return space_module.load()


@pytest.fixture(scope="module")
def design(space) -> design_module.Design:
    return design_module.build(space)


# ---- the space ---------------------------------------------------------------------------------------------------

def test_when_the_space_is_read_then_every_dimension_says_why_and_the_defaults_make_a_valid_cell(space):
    assert len(space.dimensions) >= 15
    for dimension in space.dimensions:
        assert dimension.why and dimension.seen_in, dimension.name
    space.check_cell(space.defaults())


def test_when_a_constraint_names_an_unknown_value_then_loading_says_which(tmp_path):
    text = space_module.SPACE_FILE.read_text() + '\n[[constraint]]\nwhen = { zero_stage = [7] }\n' \
                                                  'require = { world_size = [1] }\nwhy = "x"\n'
    path = tmp_path / "space.toml"
    path.write_text(text)
    with pytest.raises(space_module.SpaceError, match=r"values \[7\] that zero_stage does not have"):
        space_module.load(path)


def test_when_a_cell_breaks_a_constraint_then_check_cell_names_it(space):
    cell = {**space.defaults(), "offload_optimizer": "cpu", "zero_stage": 0}
    with pytest.raises(space_module.SpaceError, match="optimizer offload is a ZeRO feature"):
        space.check_cell(cell)


def test_when_the_space_marks_a_value_unmodelled_then_the_harness_reference_says_so_too(space):
    """space.toml's `unmodelled` and the harness's reference_gaps() agree for every value of every dimension: a cell
    is never judged by a reference that does not model it, and never skipped where it does."""
    from fixes.harness.differential import Settings, reference_gaps

    for dimension in space.dimensions:
        for value in dimension.values:
            cell = {**space.defaults(), dimension.name: value}
            gaps = reference_gaps(Settings.from_cell(cell, dict(space.run)))
            assert bool(gaps) == bool(dimension.why_unmodelled(value)), (dimension.name, value, gaps)


# ---- the design --------------------------------------------------------------------------------------------------

def test_when_the_design_is_built_then_every_required_pair_and_triple_is_covered(space, design):
    cover = design_module.coverage(space, design.cells)
    assert cover.complete, cover.proof()
    assert cover.pairs_required > 1000 and cover.triples_required == 64
    assert len(design.cells) >= 64
    for cell in design.cells:
        space.check_cell(cell)


def test_when_a_cell_holding_a_unique_pair_is_dropped_then_coverage_names_the_missing_pair(space, design):
    """The coverage check can fail: drop each cell in turn until one leaves a required tuple uncovered."""
    cells = list(design.cells)
    for index in range(len(cells) - 1, -1, -1):
        cover = design_module.coverage(space, cells[:index] + cells[index + 1:])
        if not cover.complete:
            assert "missing:" in cover.proof() and "INCOMPLETE" in cover.proof()
            assert all(design_module._contains(cells[index], t) for t in cover.missing)
            return
    pytest.fail("no cell of the design holds a tuple no other cell holds: the design has a redundant cell per tuple")


def test_when_the_design_is_built_twice_then_its_cells_are_the_same(space, design):
    assert design_module.build(space).ids == design.ids


def test_when_entries_have_trigger_cells_then_every_expressible_one_is_a_cell_of_the_design(design):
    ids = set(design.ids)
    expressible = [t for t in design.triggers if t.cell is not None]
    assert len(expressible) >= 50
    for trigger in expressible:
        assert design_module.cell_id(trigger.cell) in ids, trigger
    for trigger in design.triggers:
        assert (trigger.cell is None) == bool(trigger.why_not), trigger


def test_when_a_trigger_job_uses_what_the_space_cannot_express_then_the_projection_says_why(space):
    job = {"zero_stage": 2, "precision": "bf16", "gradient_accumulation_steps": 4, "world_size": 2,
           "grad_accum_dtype": "unset", "gradient_clipping": 0.0, "uses": ["pipeline"]}
    cell, why = design_module.project_trigger_job(space, job)
    assert cell is None and "use pipeline" in why
    cell, why = design_module.project_trigger_job(space, {**job, "uses": ["direct-backward"]})
    assert why == "" and cell["backward"] == "tensor" and cell["gradient_accumulation_steps"] == 3


# ---- the verdict (no DeepSpeed) ----------------------------------------------------------------------------------

def _trace(settings, shift: float = 0.0, at_step: int = 99):
    from fixes.harness.differential import Trace

    params = [{"w": np.full(3, 0.5 + (shift if step >= at_step else 0.0), dtype=np.float32)} for step in range(settings.steps)]
    return Trace([1.0] * settings.steps * settings.gradient_accumulation_steps, params,
                 [1.0] * settings.steps, [[0.05]] * settings.steps)


def test_when_parameters_differ_past_the_tolerance_from_a_step_then_the_verdict_names_that_step():
    from dataclasses import asdict

    from fixes.harness.differential import Settings, judge

    settings = Settings()
    reference = _trace(settings)
    deepspeed = asdict(_trace(settings, shift=1e-3, at_step=2))
    verdict = judge(settings, deepspeed, reference)
    assert (verdict.verdict, verdict.first_step, verdict.quantity) == ("differs", 2, "parameters")
    assert verdict.max_diff == pytest.approx(1e-3, rel=1e-3)
    within = asdict(_trace(settings, shift=1e-7, at_step=0))
    assert judge(settings, within, reference).verdict == "agrees"


def test_when_a_cell_holds_an_unmodelled_value_then_run_cell_does_not_judge_it():
    from fixes.harness.differential import Settings, run_cell

    verdict = run_cell(Settings(optimizer="ds-adamw"))
    assert verdict.verdict == "could not run" and "reference does not model optimizer ds-adamw" in verdict.error


def test_when_deepspeed_raises_not_implemented_then_it_is_a_refusal_not_a_crash():
    from fixes.harness.differential import refusal

    assert refusal(NotImplementedError("unsupported mix"))
    assert refusal(RuntimeError("Direct calls to tensor.backward() are not supported in this configuration"))
    assert not refusal(KeyError(0))


def test_when_a_scheduler_warms_up_then_the_first_two_steps_run_at_the_minimum_lr():
    """DeepSpeed's WarmupLR sets min_lr at construction (last_batch_iteration -1) and steps after each optimizer
    step: step 0 runs at iteration -1, step 1 at iteration 0 (gamma 0) - both at warmup_min_lr."""
    from fixes.harness.differential import Settings, scheduled_lrs

    lrs = scheduled_lrs(Settings(scheduler="WarmupDecayLR", lr=0.1, warmup_num_steps=2, total_num_steps=4,
                                 steps=5, param_groups=2), [0.1, 0.05])
    assert [round(step[0], 6) for step in lrs] == [0.0, 0.0, 0.05, 0.1, 0.05]
    assert all(step[0] == step[1] for step in lrs)  # every group gets the schedule's lr
    cycle = scheduled_lrs(Settings(scheduler="OneCycle", lr=0.1, warmup_num_steps=2, steps=6), [0.1])
    assert [round(step[0], 6) for step in cycle] == [0.01, 0.055, 0.1, 0.055, 0.01, 0.01]
    cosine = scheduled_lrs(Settings(scheduler="WarmupCosineLR", lr=0.1, warmup_num_steps=2, total_num_steps=4,
                                    steps=4, param_groups=2), [0.1, 0.05])
    assert cosine[0] == [0.0, 0.0] and cosine[3][1] == pytest.approx(cosine[3][0] / 2)  # each group's own lr


# ---- the reference against DeepSpeed, per modelled dimension ----------------------------------------------------

def _agree(cells: list[dict]) -> None:
    """Run in a release's process: every cell agrees with the reference (prints each verdict)."""
    from fixes import harness
    from fixes.harness.differential import Settings, run_cell

    harness.setup()
    run = dict(space_module.load().run)
    failed = []
    for cell in cells:
        verdict = run_cell(Settings.from_cell(cell, run))
        print(cell, verdict.as_dict(), flush=True)
        if verdict.verdict != "agrees":
            failed.append((cell, verdict.as_dict()))
    assert not failed, failed


def check_clipping() -> None:
    _agree([{"gradient_clipping": 0.5, "zero_stage": stage, "world_size": 2, "gradient_accumulation_steps": 3}
            for stage in (0, 1, 2, 3)] + [{"gradient_clipping": 0.5, "precision": "bf16", "zero_stage": 2}])


def check_accumulation_dtype_and_reduction_order() -> None:
    _agree([{"precision": "bf16", "zero_stage": stage, "gradient_accumulation_steps": 3, "world_size": 2}
            for stage in (0, 1, 2, 3)] +
           [{"precision": "bf16", "zero_stage": stage, "gradient_accumulation_steps": 3, "world_size": 2,
             "grad_accum_dtype": "fp32"} for stage in (1, 2, 3)] +
           [{"precision": "bf16", "zero_stage": stage, "gradient_accumulation_steps": 3, "world_size": 2,
             "offload_optimizer": "cpu"} for stage in (1, 2, 3)])


def check_loss_scale() -> None:
    _agree([{"precision": precision, "zero_stage": stage, "gradient_accumulation_steps": 3, "world_size": 2,
             "gradient_clipping": 0.5} for precision in ("fp16-static", "fp16-dynamic") for stage in (1, 2, 3)])


def check_schedulers_and_param_groups() -> None:
    _agree([{"scheduler": scheduler, "param_groups": groups, "zero_stage": stage}
            for scheduler in ("none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")
            for groups, stage in ((1, 0), (2, 2))] +
           [{"scheduler": scheduler, "param_groups": 2, "zero_stage": 3, "steps": 6}
            for scheduler in ("WarmupCosineLR", "OneCycle")])


def check_optimizers_and_unfused_initial_step() -> None:
    _agree([{"optimizer": optimizer, "zero_stage": 1, "param_groups": 2 if optimizer != "torch-sgd" else 1}
            for optimizer in ("torch-adamw", "torch-sgd", "torch-adam")] +
           [{"precision": "bf16", "optimizer": optimizer, "gradient_accumulation_steps": 3}
            for optimizer in ("torch-adamw", "torch-sgd")])


def check_zero_options_and_backward() -> None:
    _agree([{"zero_stage": 2, "overlap_comm": True, "reduce_bucket_size": 64, "contiguous_gradients": False,
             "round_robin_gradients": True, "offload_optimizer": "cpu", "world_size": 2},
            {"zero_stage": 3, "zero_init": True, "stage3_param_persistence_threshold": 0, "sub_group_size": 64,
             "world_size": 2, "gradient_accumulation_steps": 3},
            {"zero_stage": 2, "backward": "tensor", "precision": "bf16", "gradient_accumulation_steps": 3},
            {"zero_stage": 1, "backward": "tensor", "precision": "fp16-static", "gradient_accumulation_steps": 3}])


def check_checkpoints() -> None:
    _agree([{"checkpoint": "save-load", "zero_stage": 2, "world_size": 2, "precision": "bf16", "scheduler": "WarmupLR"},
            {"checkpoint": "save-load", "zero_stage": 3, "world_size": 2, "precision": "fp16-dynamic"},
            {"checkpoint": "universal", "zero_stage": 1, "precision": "bf16", "world_size": 2},
            {"checkpoint": "universal", "zero_stage": 3},
            {"checkpoint": "zero-to-fp32", "zero_stage": 3, "world_size": 2},
            {"checkpoint": "zero-to-fp32", "zero_stage": 2, "precision": "bf16", "world_size": 2,
             "gradient_accumulation_steps": 3}])


@pytest.mark.parametrize("check", [check_checkpoints, check_clipping, check_accumulation_dtype_and_reduction_order, check_loss_scale,
                                   check_schedulers_and_param_groups, check_optimizers_and_unfused_initial_step,
                                   check_zero_options_and_backward], ids=lambda check: check.__name__[6:])
def test_when_a_modelled_dimension_runs_on_a_release_known_right_then_the_reference_agrees(check):
    call_in_release(KNOWN_RIGHT, check, timeout=400)


# ---- the record --------------------------------------------------------------------------------------------------

def _rows(ids, release, verdict="agrees"):
    return {(cell_id, release): {"verdict": verdict, "max_diff": 0.0, "seconds": 1.0,
                                 "command": record_module.repeat_command(cell_id, release)} for cell_id in ids}


def test_when_rows_are_written_and_read_then_they_round_trip_and_later_rows_replace_theirs(tmp_path, design):
    path = tmp_path / "differential.json"
    cells = differential.cell_entries(design)
    ids = list(design.ids[:3])
    first = record_module.merge(record_module.Record(), cells, _rows(ids, "0.19.8"), {"at": "then"})
    record_module.write(first, path)
    assert record_module.read(path).as_json() == first.as_json()
    second = record_module.merge(record_module.read(path), cells, _rows(ids[:1], "0.19.8", "differs") |
                                 _rows(ids[:1], "0.16.0", "crashes"))
    assert second.row(ids[0], "0.19.8")["verdict"] == "differs"
    assert second.row(ids[1], "0.19.8")["verdict"] == "agrees"
    assert second.releases == ["0.16.0", "0.19.8"]
    assert record_module.counts(second) == {"agrees": 2, "differs": 1, "crashes": 1, "rejected": 0, "could not run": 0}


def test_when_the_record_holds_an_unknown_verdict_then_reading_refuses(tmp_path):
    path = tmp_path / "differential.json"
    path.write_text(json.dumps({"format": 1, "rows": {"abc": {"0.19.8": {"verdict": "fine"}}}}))
    with pytest.raises(record_module.RecordError, match="verdict 'fine'"):
        record_module.read(path)


def _part(tmp_path: Path, design, plan, shard: shards.Shard) -> Path:
    mine, method = differential.shard_plan(plan, shard, record_module.Record())
    rows = {(cell, release): row for release, cells in mine.items()
            for (cell, release), row in _rows(cells, release).items()}
    whole = shards.digest([[c, r] for r, cs in plan.items() for c in cs])
    last_run = {"at": "now", "wall_s": 1.0, "runs": len(rows),
                "shard": {"part": str(shard), "plan": whole, "balanced_by": method,
                          "rows": sorted([c, r] for c, r in rows)}}
    path = tmp_path / f"part{shard.index}.json"
    record_module.write(record_module.merge(record_module.Record(), differential.cell_entries(design), rows, last_run), path)
    return path


def test_when_every_shard_is_merged_then_the_record_holds_the_whole_plan_and_a_missing_part_is_refused(tmp_path, design):
    plan = {"0.19.8": list(design.ids[:5]), "0.16.0": list(design.ids[:5])}
    parts = [_part(tmp_path, design, plan, shards.Shard(i, 3)) for i in (1, 2, 3)]
    merged = differential.merge_parts(record_module.Record(), [(p, record_module.read(p)) for p in parts])
    assert sum(1 for _ in merged.all_rows()) == 10 and "shard" not in merged.last_run
    with pytest.raises(shards.ShardError, match="missing"):
        differential.merge_parts(record_module.Record(), [(p, record_module.read(p)) for p in parts[:2]])


def test_when_resuming_then_only_missing_could_not_run_and_redone_rows_are_planned(design):
    ids = list(design.ids[:3])
    old = record_module.merge(record_module.Record(), differential.cell_entries(design),
                              {**_rows(ids[:1], "0.19.8"), **_rows(ids[1:2], "0.19.8", "could not run"),
                               **_rows(ids[2:3], "0.19.8", "differs")})
    assert differential.plan_for(design, ["0.19.8"], old, ids) == {"0.19.8": ids[1:2]}
    assert differential.plan_for(design, ["0.19.8"], old, ids, redo=("could not run", "differs")) == {"0.19.8": ids[1:]}
    assert differential.plan_for(design, ["0.19.8"], None, ids) == {"0.19.8": ids}
