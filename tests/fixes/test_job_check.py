"""Which known bugs hit one job: fixbook doctor --config on configs in the shape users have them (a Hugging Face
Trainer ZeRO-3 config with "auto" values, a pipeline config with gradient accumulation, a plain bf16 ZeRO-1 config),
on two releases each, and fixes.check on a live CPU engine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci import releases
from tests.helpers import call_in_release

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"


def _doctor(release: str, config: str, *args: str) -> str:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **releases.environment(release)}
    done = subprocess.run([sys.executable, "-m", "fixes.cli", "doctor", "--config", str(CONFIGS / config), *args],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def _section(out: str, starts: str) -> set[str]:
    """The entry ids listed under the line starting with ``starts`` ("!  id:", "?  id:", "-  id:")."""
    marker = {"this job triggers": "!  ", "it may trigger": "?  ", "DeepSpeed": "-  "}[starts]
    return {line[3:].split(":")[0] for line in out.splitlines() if line.startswith(marker)}


@pytest.mark.parametrize("release, triggers, not_triggered", [
    ("0.18.2", {"pipeline-grad-accum-sums"}, {"bf16-gets-fp16-optimizer"}),
    ("0.19.0", {"pipeline-stages-divide-by-gas-twice"}, set()),
])
def test_when_a_pipeline_config_accumulates_gradients_then_doctor_names_the_pipeline_bug_of_that_release(
        release, triggers, not_triggered) -> None:
    out = _doctor(release, "pipeline_gas4.json", "--world-size", "2", "--uses", "pipeline")
    assert _section(out, "this job triggers") == triggers, out
    assert not_triggered <= _section(out, "DeepSpeed"), out
    assert 'fixes.apply("' + next(iter(triggers)) + '")' in out


@pytest.mark.parametrize("release, triggers", [
    ("0.18.4", {"bf16-gets-fp16-optimizer", "bf16-zero1-last-microbatch-allreduce"}),
    ("0.19.0", set()),
])
def test_when_a_bf16_zero1_config_accumulates_in_fp32_then_doctor_names_exactly_the_bugs_it_triggers(
        release, triggers) -> None:
    out = _doctor(release, "bf16_zero1_fp32_accum.json", "--world-size", "2", "--uses", "")
    assert _section(out, "this job triggers") == triggers, out
    assert _section(out, "it may trigger") == set(), out  # every use stated (none), nothing left open


@pytest.mark.parametrize("release", ["0.18.9", "0.19.8"])
def test_when_a_hugging_face_zero3_config_has_auto_values_then_doctor_says_which_bugs_they_decide(release) -> None:
    out = _doctor(release, "hf_trainer_zero3_auto.json", "--world-size", "8")
    assert _section(out, "this job triggers") == set(), out
    assert "zero23-no-sync-assertion" in _section(out, "it may trigger"), out
    assert "gradient_accumulation_steps: from TrainingArguments.gradient_accumulation_steps; it decides" in out
    assert "zero23-no-sync-assertion (gradient_accumulation_steps >= 2)" in out
    assert "zero12-flat-buffer-detach" not in out.split("it may trigger")[1].split("this job does not trigger")[0]


def test_when_uses_are_misspelled_then_doctor_says_which_exist() -> None:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **releases.environment("0.19.0")}
    done = subprocess.run([sys.executable, "-m", "fixes.cli", "doctor", "--config", str(CONFIGS / "pipeline_gas4.json"),
                           "--uses", "pipelines"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2 and "unknown --uses pipelines; known: direct-backward" in done.stderr


def check_a_live_zero2_engine_with_gradient_accumulation_is_warned_of_exactly_its_bug():
    import warnings

    import fixes
    from fixes import harness

    harness.setup()
    job = harness.Job(zero_stage=2, micro_steps=2)
    engine = harness.build_engine(job)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = fixes.check(engine)
    [warning] = [w for w in caught if issubclass(w.category, fixes.FixbookWarning)]
    text = str(warning.message)
    assert {f.fix.id for f in report.triggers} == {"zero2-grad-accum-last-microbatch"}, text
    assert 'fixes.apply("zero2-grad-accum-last-microbatch")' in text and "zero2-offload-grad-accum" not in text
    fixes.apply("zero2-grad-accum-last-microbatch")  # a bug fixed in this process is no longer named
    try:
        assert fixes.check(harness.build_engine(job)).triggers == ()
    finally:
        fixes.revert("zero2-grad-accum-last-microbatch")
    class Broken:  # an engine that cannot be read: the check warns and returns, it never raises into the job
        def __getattr__(self, name):
            raise RuntimeError("engine state unavailable")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert fixes.check(Broken()) is None
    assert any("fixes.check could not read this engine: RuntimeError" in str(w.message) for w in caught), caught


def test_when_a_live_engine_is_checked_then_one_warning_names_each_triggered_bug_and_patches_nothing() -> None:
    call_in_release("0.18.2", check_a_live_zero2_engine_with_gradient_accumulation_is_warned_of_exactly_its_bug)


def test_when_a_cuda_job_meets_a_trigger_measured_on_cpu_only_then_doctor_says_so_instead_of_asserting_it() -> None:
    on_cuda = _doctor("0.18.9", "bf16_zero1_fp32_accum.json", "--world-size", "2", "--uses", "", "--accelerator", "cuda")
    assert "accelerator cuda" in on_cuda
    assert "zero12-flat-buffer-detach" not in _section(on_cuda, "this job triggers"), on_cuda
    assert "zero12-flat-buffer-detach" in _section(on_cuda, "it may trigger"), on_cuda  # "?  " lines
    assert "measured on CPU; on CUDA not measured (whether this CUDA job hits them is not known" in on_cuda
    assert "its ranks on GPUs (NCCL) not measured" in on_cuda
    on_cpu = _doctor("0.18.9", "bf16_zero1_fp32_accum.json", "--world-size", "2", "--uses", "", "--accelerator", "cpu")
    assert "zero12-flat-buffer-detach" in _section(on_cpu, "this job triggers") and "on CUDA not measured" not in on_cpu


def test_when_a_live_cuda_engine_is_checked_then_a_bug_measured_on_cpu_only_is_named_as_such() -> None:
    from fixes.job_check import CPU_ONLY, summary, triggered
    from fixes.trigger import job_from_config

    job = job_from_config({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}, 2, [], "cuda")
    text = summary(triggered(job, "0.18.9"))
    assert "zero12-flat-buffer-detach: ZeRO-1/2 flat buffer not detached" in text and f"({CPU_ONLY})" in text, text
    assert CPU_ONLY not in summary(triggered(job.with_(accelerator="cpu"), "0.18.9"))


# ---- the configurations checked against PyTorch (fixes.checked, the differential record) ------------------------

def _checked_record():
    from fixes import checked

    fp16_zero0 = {"zero_stage": 0, "precision": "fp16-static", "gradient_accumulation_steps": 1, "world_size": 1}
    bf16_zero1 = {"zero_stage": 1, "precision": "bf16", "gradient_accumulation_steps": 3, "world_size": 2}
    return checked.Record(
        cells={"a": fp16_zero0, "b": bf16_zero1, "c": {**bf16_zero1, "world_size": 1}},
        rows={"a": {"0.18.2": {"verdict": "differs", "command": "python -m ci.differential --cell a --release 0.18.2"}},
              "b": {"0.18.2": {"verdict": "agrees"}, "0.19.8": {"verdict": "agrees"}},
              "c": {"0.18.2": {"verdict": "differs", "command": "python -m ci.differential --cell c --release 0.18.2"}}},
        attribution={"a": {"0.18.2": {"status": "explained", "entries": ["fp16-zero0-loss-scale"]}}},
        checked="2026-12-06 06:12 UTC")


def test_when_the_closest_checked_cells_agree_then_the_statement_says_they_agree_and_when():
    from fixes import checked
    from fixes.trigger import job_from_config

    job = job_from_config({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "train_batch_size": 24,
                           "train_micro_batch_size_per_gpu": 4}, world_size=2)
    lines = checked.statement(job, "0.19.8", _checked_record())
    assert lines[0].startswith("the 1 checked configurations closest to this job (1 alike") and \
        "agree with PyTorch on 0.19.8 (checked 2026-12-06 06:12 UTC)" in lines[0], lines


def test_when_a_close_cell_differs_then_the_statement_names_its_entry_or_says_not_explained():
    from fixes import checked
    from fixes.trigger import job_from_config

    job = job_from_config({"zero_optimization": {"stage": 0}, "fp16": {"enabled": True}, "train_batch_size": 4,
                           "train_micro_batch_size_per_gpu": 4}, world_size=1)
    lines = checked.statement(job, "0.18.2", _checked_record())
    assert lines[1].strip() == "a: differs: explained by fp16-zero0-loss-scale", lines
    assert any(line.strip().startswith("c: differs: not explained yet (python -m ci.differential --cell c") for line in lines)


def test_when_a_close_unexplained_cell_was_minimised_then_the_statement_gives_its_smallest_configuration():
    from dataclasses import replace

    from fixes import checked
    from fixes.trigger import job_from_config

    record = replace(_checked_record(), minimised={"c~0": {
        "cell": "c", "signature": "differs: parameters", "rows": ["0.18.2"], "set": {"precision": "bf16"},
        "first": "0.17.0", "last": "0.18.2"}})
    job = job_from_config({"zero_optimization": {"stage": 0}, "fp16": {"enabled": True}, "train_batch_size": 4,
                           "train_micro_batch_size_per_gpu": 4}, world_size=1)
    lines = checked.statement(job, "0.18.2", record)
    assert any(line.strip().startswith("c: differs: not explained yet; smallest configuration that fails so: "
                                       "precision=bf16, on 0.17.0 - 0.18.2") for line in lines), lines


def test_when_no_cell_was_checked_on_the_release_then_the_statement_says_which_were():
    from fixes import checked
    from fixes.trigger import job_from_config

    job = job_from_config({"zero_optimization": {"stage": 0}, "train_batch_size": 4}, world_size=1)
    assert checked.statement(job, "0.10.0", _checked_record()) == [
        "no configuration was checked against PyTorch on DeepSpeed 0.10.0 (checked releases: 0.18.2, 0.19.8)"]


def test_when_doctor_checks_a_megatron_config_then_it_prints_the_checked_configurations_statement():
    out = _doctor("0.18.9", "megatron_gpt_zero3.json", "--world-size", "2")
    assert "checked configurations closest to this job" in out and "on 0.18.9 (checked " in out, out


def test_when_the_record_is_read_again_then_it_is_parsed_once_until_the_file_changes(tmp_path, monkeypatch):
    import json as json_module

    from fixes import checked

    path = tmp_path / "differential.json"
    path.write_text(json_module.dumps({"cells": {"a": {"cell": {"zero_stage": 1}}}, "rows": {}}))
    parses = []
    loads = json_module.loads
    monkeypatch.setattr(checked.json, "loads", lambda text: parses.append(1) or loads(text))
    assert checked.read(path).cells == checked.read(path).cells == {"a": {"zero_stage": 1}}
    assert len(parses) == 1
    path.write_text(json_module.dumps({"cells": {"b": {"cell": {"zero_stage": 2}}}, "rows": {}}))  # a new size
    assert checked.read(path).cells == {"b": {"zero_stage": 2}} and len(parses) == 2
