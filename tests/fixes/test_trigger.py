"""fixes.trigger: a job read from a DeepSpeed config, conditions that answer True, False or open, and a trigger held
to a measured grid (every entry's against its own: tests/fixes/test_contract.py)."""
from __future__ import annotations

import pytest

from fixes import trigger
from fixes.trigger import UNSET, Trigger, gas, job_from_config, stage, uses


def test_when_a_config_holds_auto_values_then_they_are_open_and_named() -> None:
    job = job_from_config({"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": "auto",
                           "bf16": {"enabled": "auto"}, "gradient_clipping": "auto"}, world_size=8)
    assert (job.zero_stage, job.gradient_accumulation_steps, job.precision, job.gradient_clipping) == (3, None, None, None)
    assert set(job.unresolved) == {"gradient_accumulation_steps", "bf16.enabled", "gradient_clipping"}


def test_when_a_config_leaves_keys_out_then_deepspeeds_defaults_apply() -> None:
    job = job_from_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert (job.zero_stage, job.precision, job.gradient_accumulation_steps, job.gradient_clipping) == (0, "fp32", 4, UNSET)
    assert job.offload_optimizer is False and job.contiguous_gradients is True
    legacy = job_from_config({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert legacy.offload_optimizer is True


def test_when_conditions_answer_then_the_trigger_says_triggered_not_or_if() -> None:
    bug = Trigger(stage(2), gas(at_least=2), uses("no-sync"))
    stated = job_from_config({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 4}, uses=["no-sync"])
    assert bug.evaluate(stated).triggered is True
    assert bug.evaluate(stated.with_(zero_stage=1)).false == ("ZeRO stage 2",)
    open_ = bug.evaluate(job_from_config({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": "auto"}))
    assert open_.triggered is None and len(open_.open) == 2 and open_.why.startswith("if: ")
    assert bug.evaluate(stated.with_(uses=frozenset())).triggered is False  # stated: no no_sync


def test_when_a_use_is_misspelled_then_the_error_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: direct-backward"):
        uses("nosync")
    with pytest.raises(ValueError, match="unknown use"):
        job_from_config({}, uses=["nosync"])


def test_when_a_trigger_disagrees_with_a_measured_cell_then_the_check_names_the_cell(tmp_path) -> None:
    import json

    job = trigger.job_to_record(job_from_config({"zero_optimization": {"stage": 1}}))
    (tmp_path / "grids.json").write_text(json.dumps({"entries": {"e": {
        "release": "0.18.2", "date": "2026-11-26", "code": "x",
        "cells": [{"label": "ZeRO-1", "flips": "zero_stage", "job": job, "reproduced": True}]}}}))
    grid = trigger.recorded_grid("e", Trigger(stage(2)), tmp_path / "grids.json")
    assert grid is not None and grid.disagreements == [
        "ZeRO-1: the trigger says not triggered, the run reproduced the bug"]
