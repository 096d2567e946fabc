"""fixes.record: where a run ran, as the run history and the entry cards read it."""
from __future__ import annotations

import json
from pathlib import Path

from fixes.record import RunRecord, RunResult, RunSummary, gpu_status, history, record_runs, summarize

# What harness.describe() stores: ``device`` names the processor or the GPU, ``accelerator`` is where DeepSpeed ran.
CUDA_ENV = {"python": "3.12.3", "torch": "2.11.0+cu130", "deepspeed": "0.18.9", "accelerator": "cuda",
            "device": "NVIDIA H100 80GB HBM3", "world_size": 1, "rank": 0}
CPU_ENV = {**CUDA_ENV, "accelerator": "cpu", "device": "x86_64", "python": "3.11.7", "torch": "2.13.0"}


def _result(environment: dict, entry: str = "e", release: str = "0.18.9", fixed: bool = True) -> RunResult:
    record = RunRecord.from_json({"entry": entry, "environment": environment, "affected": True,
                                  "reproduced": {"kind": "error", "detail": "boom"}, "fix_action": "applied",
                                  "verified": [{"name": "w", "dtype": "float32", "max_abs_diff": 0.0, "close": fixed}]})
    return RunResult(entry, release, "k", "nb.ipynb", "out.ipynb", "passed", 1.0, record=record, environment="gpu")


def test_when_a_run_used_cuda_then_its_summary_says_cuda_and_names_the_gpu() -> None:
    summary = summarize(_result(CUDA_ENV), "2026-11-26")
    assert summary.device == "cuda" and summary.gpu == "NVIDIA H100 80GB HBM3"


def test_when_the_processor_has_a_name_then_a_cpu_run_is_still_cpu() -> None:
    summary = summarize(_result(CPU_ENV), "2026-11-26")
    assert summary.device == "cpu" and summary.gpu == ""


def test_when_a_cuda_run_reproduced_and_fixed_then_the_gpu_status_names_release_gpu_python_and_torch() -> None:
    status = gpu_status("e", [summarize(_result(CUDA_ENV), "2026-11-26")])
    assert status.startswith("reproduced and fixed on CUDA: DeepSpeed 0.18.9 ("), status
    assert all(part in status for part in ("NVIDIA H100 80GB HBM3", "Python 3.12.3", "torch 2.11.0+cu130")), status


def test_when_a_cuda_notebook_ran_its_ranks_on_cpu_then_the_gpu_status_does_not_call_that_a_fix_on_cuda() -> None:
    result = _result(CUDA_ENV)
    result.record.rank_devices = ["cpu"]
    status = gpu_status("e", [summarize(result, "2026-11-26")])
    assert status.startswith("reproduced and fixed by the notebook on a one-GPU machine, its ranks on CPU"), status
    assert "reproduced and fixed on CUDA" not in status, status
    assert summarize(_result(CPU_ENV), "2026-11-26").ranks == ""


def test_when_a_harness_launch_places_ranks_then_the_notebooks_record_says_where(tmp_path: Path) -> None:
    from fixes.harness import env
    from fixes.harness.report import Report

    report = Report("e", str(tmp_path / "record.json"))
    env.RANK_DEVICES.add("cpu")
    try:
        report.note("after a launch")
    finally:
        env.RANK_DEVICES.discard("cpu")
    assert json.loads((tmp_path / "record.json").read_text())["rank_devices"] == ["cpu"]


def test_when_one_cuda_release_failed_then_the_gpu_status_says_so_beside_the_passes() -> None:
    runs = [summarize(_result(CUDA_ENV), "2026-11-26"),
            summarize(_result(CUDA_ENV, release="0.19.8", fixed=False), "2026-11-26")]
    status = gpu_status("e", runs)
    assert "DeepSpeed 0.18.9;" in status and "failed on CUDA: 0.19.8: reproduced, fix not verified" in status, status


def test_when_a_cuda_notebook_failed_then_the_gpu_status_says_at_which_cell_and_error_without_machine_paths() -> None:
    failed = _result(CUDA_ENV, release="0.19.8")
    failed.status, failed.failed_cell = "failed", 10
    failed.error = ("AssertionError: a run failed: [\"ValueError: invalid literal for int() with base 10: '0a'\"] "
                    "(/tmp/fixbook-device-x/build/executed/0.19.8-gpu/e.ipynb)\nTraceback ...")
    summary = summarize(failed, "2026-11-27")
    assert summary.reason == ("cell 10: AssertionError: a run failed: [\"ValueError: invalid literal for int() with "
                              "base 10: '0a'\"] (e.ipynb)"), summary.reason
    status = gpu_status("e", [summary])
    assert status.startswith(f"failed on CUDA: 0.19.8: notebook failed ({summary.reason})"), status
    assert "/tmp" not in status and "Traceback" not in status
    assert summarize(_result(CUDA_ENV), "2026-11-27").reason == ""


def test_when_a_failure_reason_is_long_then_it_is_cut_to_its_limit() -> None:
    from fixes.record import REASON_CHARS, failure_reason

    failed = _result(CUDA_ENV)
    failed.status, failed.failed_cell, failed.error = "failed", 3, "ToleranceError: " + "x" * 500
    reason = failure_reason(failed)
    assert reason.startswith("cell 3: ToleranceError: xxx") and reason.endswith("…")
    assert len(reason) == len("cell 3: ") + REASON_CHARS


def test_when_cuda_runs_passed_only_where_the_release_is_not_affected_then_no_fix_is_claimed_verified() -> None:
    record = RunRecord(entry="e", environment=CUDA_ENV, affected=False)
    runs = [summarize(RunResult("e", "0.19.8", "k", "nb", "out", "passed", 1.0, record=record), "2026-11-26")]
    status = gpu_status("e", runs)
    assert status.startswith("passed, not affected on CUDA: DeepSpeed 0.19.8 ("), status
    assert "fixed" not in status, status


def test_when_no_cuda_run_is_recorded_then_the_gpu_status_says_not_run() -> None:
    assert gpu_status("e", [summarize(_result(CPU_ENV), "2026-11-26")]).startswith("not run on a GPU yet")


def test_when_a_history_row_predates_the_gpu_field_then_it_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "runs.json"
    old = {"entry": "e", "release": "0.18.9", "environment": "cpu", "device": "cpu", "python": "3.11.7",
           "torch": "2.13.0", "verdict": "reproduced → fixed", "at": "2026-11-24"}
    path.write_text(json.dumps({"runs": [old]}))
    record_runs([summarize(_result(CUDA_ENV), "2026-11-26")], path)
    rows = history(path)
    assert [(r.device, r.gpu) for r in rows] == [("cpu", ""), ("cuda", "NVIDIA H100 80GB HBM3")]
    assert isinstance(rows[0], RunSummary)


def test_when_a_record_is_locked_then_a_second_writer_waits_until_it_is_released(tmp_path: Path) -> None:
    import threading

    from fixes.files import locked

    path, entered = tmp_path / "runs.json", threading.Event()

    def second() -> None:
        with locked(path):
            entered.set()

    with locked(path):
        waiting = threading.Thread(target=second)
        waiting.start()
        assert not entered.wait(0.3)  # it cannot get in while the first holds the lock
    waiting.join(30)
    assert entered.is_set()
