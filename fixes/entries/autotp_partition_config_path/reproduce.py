"""How autotp-partition-config-path is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. The runs themselves are in ``autotp.py`` beside it."""
from __future__ import annotations

import importlib.util
from typing import Any

from ...exceptions import CannotTellError


def has_custom_patterns() -> bool:
    """Whether the installed DeepSpeed has AutoTP's custom partition patterns at all (``tensor_parallel.
    partition_config`` / ``preset_model``, whose specs live in ``deepspeed.module_inject.autotp_config``). Where it
    has not, the config key is rejected (or the whole ``tensor_parallel`` block ignored) and no pattern can
    mis-match."""
    return importlib.util.find_spec("deepspeed.module_inject.autotp_config") is not None


def not_sharded(job: Any, world_size: int = 2, timeout: float = 180.0) -> bool:
    """``deepspeed.initialize`` on ``world_size`` ranks with ``job``'s config: True if a rank holds whole a weight
    the patterns shard, False if every rank holds exactly the configured shards. Raises CannotTellError where a rank
    holds something else (a shard of another size: not this bug)."""
    from ...harness import launch
    from .autotp import PARTITION_CONFIG, build_in_rank, configured_shapes, full_shapes

    tensor_parallel = job.config["tensor_parallel"]
    configured = configured_shapes(tensor_parallel.get("partition_config") or PARTITION_CONFIG,
                                   tensor_parallel["autotp_size"])
    full = full_shapes()
    held = [{name: tuple(shape) for name, shape in rank["held"].items()}
            for rank in launch(build_in_rank, world_size, job, timeout=timeout)]
    if all(shapes == configured for shapes in held):
        return False
    whole = [name for shapes in held for name, shape in shapes.items() if shape != configured[name]]
    if all(held_shape == full[name] for shapes in held for name, held_shape in shapes.items() if name in whole):
        return True
    raise CannotTellError(f"the ranks hold {held}, neither the configured shards {configured} nor the whole weights")


def reproduce() -> bool:
    """Two ranks, ``autotp_size`` 2, the user's ``partition_config`` (column ``.*\\.mlp\\.up_proj\\.weight$``, row
    ``.*\\.mlp\\.down_proj\\.weight$``) on a model whose layers sit at ``layers.{i}.mlp``: True if after
    ``deepspeed.initialize`` a rank still holds a whole weight that the patterns shard. False on a release without
    custom partition patterns (nothing there to match)."""
    if not has_custom_patterns():
        return False
    from .autotp import autotp_job

    return not_sharded(autotp_job())


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`not_sharded`: the user's custom patterns on
    two ranks (the sweep's check), the ``llama`` preset instead (its patterns name the enclosing module the same
    way), ZeRO-1 with bf16 instead of ZeRO-0 with fp32 (the name matching comes before either), then one rank with
    ``autotp_size`` 1 (nothing to shard). What ``fixes.trigger`` cannot read of a job (``tensor_parallel``, the
    patterns, how deep the layers sit) stays out of the grid; the trigger's note states it, and the notebook shows
    patterns that still match."""
    from ...harness import Cell, ds_config, trigger_job
    from .autotp import autotp_job

    def cell(label: str, job: Any, world_size: int = 2, flips: str = "") -> Cell:
        return Cell(label, trigger_job(ds_config(job, world_size), world_size),
                    lambda: not_sharded(job, world_size), flips)

    return [cell("autotp_size 2, partition_config patterns naming the enclosing module, ZeRO-0, fp32", autotp_job()),
            cell("preset_model llama instead of the custom patterns", autotp_job(preset_model="llama")),
            cell("ZeRO-1 with bf16 instead", autotp_job(zero_stage=1, dtype="bfloat16")),
            cell("one rank, autotp_size 1", autotp_job(autotp_size=1), world_size=1, flips="autotp_size|world_size")]
