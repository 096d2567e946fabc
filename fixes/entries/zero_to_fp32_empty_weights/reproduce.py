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
