"""ci.tools.device: notebook runs on a lent GPU machine, recorded as CUDA runs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ci.tools import device
from ci import releases
from fixes.record import RunRecord, RunResult, gpu_status, history


def test_when_no_gpu_is_visible_then_a_device_run_refuses_before_installing_anything(tmp_path: Path) -> None:
    with pytest.raises(device.DeviceError, match="no GPU is visible"):
        device.run(tmp_path / "out", bundle_dir=tmp_path / "bundle")
    assert not (tmp_path / "out").exists()


def test_when_the_bundle_is_resolved_then_the_runner_is_pinned_and_numpy_and_torch_stay_behind() -> None:
    from importlib.metadata import version

    wanted = device.requirements()
    names = [line.split("==")[0].lower() for line in wanted]
    assert f"papermill=={version('papermill')}" in wanted and f"ipykernel=={version('ipykernel')}" in wanted
    assert "numpy" not in names and "torch" not in names and "pydantic" in names and "hjson" in names


def test_when_a_release_is_packed_then_its_source_travels_without_byte_code_or_this_machines_built_ops(
        tmp_path: Path) -> None:
    import tarfile

    release = tmp_path / "0.19.8"
    for name in ("deepspeed/__init__.py", "deepspeed/__pycache__/__init__.cpython-311.pyc",
                 ".torch_extensions/cpu/fused_adam/fused_adam.so", "deepspeed/ops/csrc/adam.cpp"):
        (release / name).parent.mkdir(parents=True, exist_ok=True)
        (release / name).write_text("x")
    with tarfile.open(tmp_path / "r.tar.gz", "w:gz") as tar:
        tar.add(release, arcname="0.19.8", filter=device._source_only)
    with tarfile.open(tmp_path / "r.tar.gz") as tar:
        files = sorted(member.name for member in tar.getmembers() if member.isfile())
    assert files == ["0.19.8/deepspeed/__init__.py", "0.19.8/deepspeed/ops/csrc/adam.cpp"]


def test_when_kernels_are_written_then_each_runs_this_python_with_its_release_the_bundle_and_this_checkout(
        tmp_path: Path) -> None:
    names = device.write_kernels(["0.18.9", "0.19.8"], tmp_path / "site", tmp_path / "jupyter")
    assert names == {("0.18.9", "gpu"): "deepspeed-0.18.9-gpu", ("0.19.8", "gpu"): "deepspeed-0.19.8-gpu"}
    spec = json.loads((tmp_path / "jupyter" / "kernels" / "deepspeed-0.18.9-gpu" / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable
    path = spec["env"]["PYTHONPATH"].split(":")
    assert path == [str(releases.install_dir("0.18.9")), str(tmp_path / "site"), str(device.ROOT)]
    assert "DS_ACCELERATOR" not in spec["env"] and spec["env"]["FIXBOOK_ENVIRONMENT"] == "gpu"


def test_when_the_matrix_is_asked_then_each_notebook_runs_where_ci_runs_it_in_the_project_venv() -> None:
    from ci.notebooks import runner

    assert device.matrix() == [(e, r, "gpu") for e, r, _ in runner.matrix(environments=["cpu"])]


def test_when_only_some_runs_are_asked_then_the_matrix_keeps_just_those_and_refuses_one_it_does_not_run() -> None:
    from ci.notebooks import runner

    some = [(e, r) for e, r, _ in runner.matrix(environments=["cpu"])][:3:2]
    assert device.matrix(only=some) == [(e, r, "gpu") for e, r in some]
    with pytest.raises(device.DeviceError, match="not in the notebook matrix: zero3-linear-setup-context@0.16.1"):
        device.matrix(only=[("zero3-linear-setup-context", "0.16.1")])
    with pytest.raises(device.DeviceError, match="ENTRY@RELEASE"):
        device.parse_only(["zero3-linear-setup-context"])


def test_when_a_device_run_is_recorded_then_its_cuda_runs_reach_the_gpu_status(tmp_path: Path) -> None:
    env = {"python": "3.12.3", "torch": "2.11.0+cu130", "accelerator": "cuda", "device": "NVIDIA H100 80GB HBM3"}
    record = RunRecord(entry="zero3-linear-setup-context", environment=env, affected=False)
    result = RunResult("zero3-linear-setup-context", "0.19.8", "deepspeed-0.19.8-gpu", "nb", "out", "passed", 3.0,
                       record=record, environment="gpu")
    (tmp_path / device.RESULTS).write_text(json.dumps({"machine": {"gpu": env["device"], "at": "2026-11-26"}}) + "\n"
                                           + json.dumps({"result": result.to_json()}) + "\n")
    path = tmp_path / "runs.json"
    device.record(tmp_path, path)
    [row] = history(path)
    assert (row.environment, row.device, row.gpu, row.at) == ("gpu", "cuda", "NVIDIA H100 80GB HBM3", "2026-11-26")
    assert gpu_status("zero3-linear-setup-context", [row]).startswith("passed, not affected on CUDA: DeepSpeed 0.19.8")


def test_when_a_two_gpu_machine_is_lent_then_the_two_rank_checks_run_are_those_whose_ranks_ran_on_cpu() -> None:
    runs = history()
    checks = device.two_rank_checks(runs)
    on_cpu = {(r.entry, r.release) for r in runs if r.device == "cuda" and r.ranks == "cpu"}
    assert checks and set(checks) == on_cpu & {(e, r) for e, r, _ in device.matrix()}
    assert ("zero12-flat-buffer-detach", "0.18.9") in checks
    assert ("zero3-linear-setup-context", "0.18.9") not in checks  # one process: its CUDA run measured it already
    assert device.matrix(only=checks) == [(e, r, "gpu") for e, r in checks]  # each is a run of the notebook matrix


def test_when_the_two_rank_bundle_is_asked_then_it_holds_exactly_the_two_rank_checks(monkeypatch) -> None:
    asked = {}
    monkeypatch.setattr(device, "bundle", lambda entries, python, only=None: asked.setdefault("only", only) and "b")
    assert device.main(["bundle", "--ranks-on-gpus"]) == 0
    assert asked["only"] == device.two_rank_checks()


def test_when_fewer_than_two_gpus_are_visible_then_the_two_rank_run_refuses_before_installing_anything(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(device, "gpu_name", lambda python=sys.executable: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(device, "gpu_count", lambda python=sys.executable: 1)
    with pytest.raises(device.DeviceError, match="1 GPU.s. visible: the two-rank checks need 2, one per rank"):
        device.run(tmp_path / "out", bundle_dir=tmp_path / "bundle", ranks_on_gpus=True)
    assert not (tmp_path / "out").exists()
