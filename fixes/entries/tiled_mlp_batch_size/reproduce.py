"""How tiled-mlp-batch-size is reproduced: the fast check the release sweep runs (``reproduce()``: True where the
bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its probe.
The model and the two ways of training it are in ``tiled.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError
USE = "tiled-compute-batch"  # the trigger's use (fixes.trigger.USES)


def sweep_job(**changes: Any) -> Any:
    """The user's job: ZeRO-3 (what ALST runs), float32, SGD, three steps, in one process."""
    from ...harness import Job

    return Job(zero_stage=3, steps=3).with_(**changes)


def differences(job: Any, tiling: str | None, batch: int, seq: int | None = None) -> list[Any]:
    """The stack with ``tiling`` trained through DeepSpeed (``tiled.train``) against plain PyTorch untiled
    (``tiled.reference``): the ``harness.compare`` of the losses and of the weights after training."""
    from ...harness import compare
    from . import tiled

    seq = tiled.SEQ if seq is None else seq
    run = tiled.train(job, tiling, batch=batch, seq=seq)
    want = tiled.reference(job, batch=batch, seq=seq)
    return [compare(run.losses, want.losses, job.dtype, "losses per step"),
            compare(run.params, want.params, job.dtype, "weights after training")]


def wrong(job: Any, tiling: str | None, batch: int) -> bool:
    """True where the run differs from plain PyTorch beyond ``TOLERANCES``; CannotTellError where it fails."""
    from . import tiled

    if not tiled.has_tiled_compute():
        raise CannotTellError("this DeepSpeed has no ALST tiled compute (TiledMLP, sequence_tiled_compute) to run")
    try:
        found = differences(job, tiling, batch)
    except Exception as exc:  # noqa: BLE001 - a run that fails says nothing about the gradients
        raise CannotTellError(f"the training run failed: {type(exc).__name__}: {exc}") from exc
    return not all(comparison.close for comparison in found)


def wrong_block(tiling: str, dtype: str, batch: int) -> bool:
    """One block, no engine (``tiled.gradients``): True where its output or gradients differ from plain PyTorch
    run tile by tile (``tiled.tile_by_tile``) beyond ``TOLERANCES``; the check for bf16, whose tile-by-tile
    gradient sums round differently from the untiled model's."""
    from ...harness import compare
    from . import tiled

    if not tiled.has_tiled_compute():
        raise CannotTellError("this DeepSpeed has no ALST tiled compute (TiledMLP, sequence_tiled_compute) to run")
    return not compare(tiled.gradients(tiling, dtype, batch), tiled.tile_by_tile(tiling, dtype, batch), dtype).close


def reproduce() -> bool:
    """The two-MLP stack, each MLP's forward through ``TiledMLP.apply`` and then through
    ``sequence_tiled_compute`` (12 tokens in 4 tiles), two sequences per micro-batch, ZeRO-3, float32, three
    steps through ``deepspeed.initialize`` / ``engine.backward`` / ``engine.step``: True if the losses or the
    weights differ from the untiled stack trained in plain PyTorch beyond the float32 tolerance. False on a
    DeepSpeed without ALST's tiled compute: no job can call it there (the probe says so)."""
    from . import tiled

    if not tiled.has_tiled_compute():
        return False
    job = sweep_job()
    return any([wrong(job, tiling, tiled.BATCH) for tiling in tiled.TILINGS])


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (TiledMLP, two sequences per micro-batch,
    ZeRO-3, float32), the same with ``sequence_tiled_compute``, with ZeRO-1, and in bf16 (the trigger holds for
    any ZeRO stage and dtype; bf16 is checked on one block against plain PyTorch tile by tile, :func:`wrong_block`,
    since bf16 training drifts from the untiled model by rounding alone), then the use turned off either way: one
    sequence per micro-batch, and the MLP without tiling."""
    from ...harness import Cell, trigger_job

    base = sweep_job()

    def cell(label: str, job: Any, tiling: str | None, batch: int, flips: str = "") -> Cell:
        used = [USE] if tiling is not None and batch > 1 else []
        run = ((lambda: wrong_block(tiling, job.dtype, batch)) if job.dtype == "bfloat16" else
               (lambda: wrong(job, tiling, batch)))
        return Cell(label, trigger_job(job.with_(micro_batch=batch), 1, uses=used), run, flips)

    return [cell("TiledMLP, 2 sequences per micro-batch, ZeRO-3", base, "TiledMLP", 2),
            cell("sequence_tiled_compute instead", base, "sequence_tiled_compute", 2),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "TiledMLP", 2),
            cell("bf16 instead", base.with_(dtype="bfloat16"), "TiledMLP", 2),
            cell("1 sequence per micro-batch", base, "TiledMLP", 1, f"uses:{USE}"),
            cell("the MLP without tiling", base, None, 2, f"uses:{USE}")]
