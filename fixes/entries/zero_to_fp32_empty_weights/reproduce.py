"""How zero-to-fp32-empty-weights is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe.

Also what the notebook shares with it: :func:`load_converted` (read back what the converter wrote, in
whichever layout the release writes) and :func:`converted_vs_trained`.
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from ...exceptions import CannotTellError

WEIGHT_FILES = ("pytorch_model.bin", "model.safetensors")
INDEX_FILES = ("pytorch_model.bin.index.json", "model.safetensors.index.json")


def _load_file(path: str) -> dict[str, Any]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)


def load_converted(output_dir: str) -> dict[str, Any]:
    """The state dict the converter wrote to ``output_dir``: one ``pytorch_model.bin`` /
    ``model.safetensors``, or the shards an ``*.index.json`` names."""
    for index_name in INDEX_FILES:
        index_path = os.path.join(output_dir, index_name)
        if os.path.exists(index_path):
            with open(index_path) as handle:
                shards = sorted(set(json.load(handle)["weight_map"].values()))
            state: dict[str, Any] = {}
            for shard in shards:
                state.update(_load_file(os.path.join(output_dir, shard)))
            return state
    for name in WEIGHT_FILES:
        path = os.path.join(output_dir, name)
        if os.path.exists(path):
            return _load_file(path)
    raise FileNotFoundError(f"no converted weights in {output_dir}: {sorted(os.listdir(output_dir))}")


def converted_vs_trained(converted: dict[str, Any], trained: dict[str, Any], name: str) -> Any:
    """``harness.compare`` of the converted weights against the trained (gathered) ones, fp32
    tolerance, on the trained parameters' names."""
    from ...harness import compare

    missing = sorted(set(trained) - set(converted))
    if missing:
        raise AssertionError(f"{name}: the converted state dict lacks {missing}")
    return compare({k: converted[k] for k in trained}, trained, "float32", name)


def reproduce() -> bool:
    """A tiny ZeRO-2 job, one step, ``engine.save_checkpoint``, then the library's
    ``convert_zero_checkpoint_to_fp32_state_dict`` with its default ``max_shard_size``: True if the
    weights it wrote differ from the engine's beyond the fp32 tolerance."""
    try:
        import huggingface_hub  # noqa: F401 - the default max_shard_size path imports it
    except ImportError as exc:
        raise CannotTellError("huggingface_hub is not installed: convert_zero_checkpoint_to_fp32_state_dict's "
                              "default max_shard_size path needs it") from exc
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    from ...harness import Job, build_engine, gathered_params, make_batches, mse

    job = Job(zero_stage=2, steps=1)
    engine = build_engine(job)
    x, y = make_batches(job.model, steps=1).micro(0, 0, 0)
    engine.backward(mse(engine(x), y))
    engine.step()
    trained = gathered_params(engine.module)
    with tempfile.TemporaryDirectory(prefix="fixbook-zero-to-fp32-") as directory:
        checkpoint, output = os.path.join(directory, "checkpoint"), os.path.join(directory, "fp32")
        engine.save_checkpoint(checkpoint)
        try:
            convert_zero_checkpoint_to_fp32_state_dict(checkpoint, output)
        except Exception as exc:  # noqa: BLE001 - a conversion that fails says nothing about empty weights
            raise CannotTellError(f"the conversion failed: {type(exc).__name__}: {exc}") from exc
        converted = load_converted(output)
    return not converted_vs_trained(converted, trained, "converted vs trained").close


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def _trained(job: Any) -> tuple[Any, dict[str, Any]]:
    """``job``'s engine after one SGD step (as :func:`reproduce` takes it) and its gathered weights."""
    from ...harness import build_engine, gathered_params, make_batches, mse

    engine = build_engine(job)
    x, y = make_batches(job.model, steps=1).micro(0, 0, 0)
    engine.backward(mse(engine(x), y))
    engine.step()
    return engine, gathered_params(engine.module)


def converted_differs(job: Any) -> bool:
    """:func:`reproduce` for any one-rank ``job``: one step, ``save_checkpoint``,
    ``convert_zero_checkpoint_to_fp32_state_dict`` with its default ``max_shard_size``; True if the weights it wrote
    differ from the engine's. CannotTellError where the conversion fails (a checkpoint it cannot read)."""
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    engine, trained = _trained(job)
    with tempfile.TemporaryDirectory(prefix="fixbook-zero-to-fp32-grid-") as directory:
        checkpoint, output = os.path.join(directory, "checkpoint"), os.path.join(directory, "fp32")
        engine.save_checkpoint(checkpoint)
        try:
            convert_zero_checkpoint_to_fp32_state_dict(checkpoint, output)
        except Exception as exc:  # noqa: BLE001 - a conversion that fails says nothing about empty weights
            raise CannotTellError(f"the conversion failed: {type(exc).__name__}: {exc}") from exc
        converted = load_converted(output)
    return not converted_vs_trained(converted, trained, "converted vs trained").close


def reloaded_differs(job: Any) -> bool:
    """The same job without zero_to_fp32: one step, ``save_checkpoint``, a fresh engine ``load_checkpoint``s it;
    True if its weights differ from the saved engine's."""
    from ...harness import build_engine, gathered_params

    engine, trained = _trained(job)
    with tempfile.TemporaryDirectory(prefix="fixbook-zero-to-fp32-grid-") as directory:
        engine.save_checkpoint(directory)
        fresh = build_engine(job)
        load_path, _ = fresh.load_checkpoint(directory)
        if load_path is None:
            raise CannotTellError(f"load_checkpoint found no checkpoint in {directory}")
        return not converted_vs_trained(gathered_params(fresh.module), trained, "reloaded vs trained").close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's check (ZeRO-2, one step, ``save_checkpoint``,
    ``convert_zero_checkpoint_to_fp32_state_dict`` with its default ``max_shard_size``), then ZeRO-1, ZeRO-3 and
    ZeRO-0 instead, and the job without zero_to_fp32 (the checkpoint loaded into a fresh engine instead). A ZeRO-0
    checkpoint holds no ZeRO optimizer files for zero_to_fp32 to read: that cell records what the converter does
    with it. Not in the grid, because a job's config cannot show it: ``max_shard_size=None`` (no shard plan) and
    ``get_fp32_state_dict_from_zero_checkpoint`` write or return the trained weights on the same release."""
    try:
        import huggingface_hub  # noqa: F401 - the default max_shard_size path imports it
    except ImportError as exc:
        raise CannotTellError("huggingface_hub is not installed: convert_zero_checkpoint_to_fp32_state_dict's "
                              "default max_shard_size path needs it") from exc
    from ...harness import Cell, Job, trigger_job

    def cell(label: str, job: Job, flips: str = "", convert: bool = True) -> Cell:
        return Cell(label, trigger_job(job, 1, uses=("zero-to-fp32",) if convert else ()),
                    (lambda: converted_differs(job)) if convert else (lambda: reloaded_differs(job)), flips)

    base = Job(zero_stage=2, steps=1)
    return [cell("ZeRO-2, convert_zero_checkpoint_to_fp32_state_dict", base),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("ZeRO-3 instead", base.with_(zero_stage=3), "zero_stage"),
            cell("ZeRO-0 instead", base.with_(zero_stage=0), "zero_stage"),
            cell("no zero_to_fp32: load_checkpoint into a fresh engine", base, "uses:zero-to-fp32", convert=False)]
