"""How zero3-hpz-stale-secondary-after-load is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. The runs themselves are in ``hpz.py`` beside it."""
from __future__ import annotations

from typing import Any


def reproduce(loads: tuple[str, ...] = ("gathered", )) -> bool:
    """Two ranks, ZeRO-3 with ``zero_hpz_partition_size=2``: load other weights into a model built inside
    ``zero.Init`` with ``GatheredParameters(modifier_rank=0)`` (what ``transformers`` does), then train. True if
    the losses or the final weights differ from plain PyTorch trained from the loaded weights (beyond
    ``TOLERANCES``). The sweep checks this one load (one launch of two ranks); ``loads=hpz.LOADS`` also resumes a
    fresh engine with ``load_checkpoint`` (two more launches; the notebook and the tests run both)."""
    from ...harness import compare
    from .hpz import hpz_job, run

    job = hpz_job()
    for load in loads:
        result = run(job, load)
        if not (compare(result.losses, result.reference_losses, job.dtype, "losses").close
                and compare(result.params, result.reference_params, job.dtype, "params").close):
            return True
    return False


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def _model(job: Any, spec: Any) -> tuple[Any, dict[str, Any], Any]:
    """:func:`hpz._build` where ``job.zero3_init``; otherwise the model built plainly (a ZeRO-1/2 script's)."""
    import os

    import fixes

    from ...harness import TinyMLP, ds_config
    from ...harness.training import make_optimizer
    from . import hpz

    if job.zero3_init:
        return hpz._build(job, spec)
    if job.fixes:
        fixes.apply(*job.fixes)
    return TinyMLP(spec), ds_config(job, int(os.environ.get("WORLD_SIZE", "1"))), make_optimizer


def grid_load_and_train(job: Any) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): :func:`hpz.load_and_train` (the pretrained load:
    ``GatheredParameters(modifier_rank=0)``, rank 0 writes), the model built by :func:`_model`."""
    import numpy as np

    from ...harness.training import gathered_params
    from . import hpz

    model, config, make_optimizer = _model(job, hpz.INITIAL)
    hpz._load_gathered(model, job.model)
    engine = hpz._initialize(job, model, config, make_optimizer)
    stale = hpz.secondary_stale(engine.module)
    losses = hpz._train(engine, job, range(job.steps))
    return {"losses": np.array(losses), "stale": np.array(stale), "params": gathered_params(engine.module)}


def grid_train_only(job: Any) -> dict[str, Any]:
    """One rank: the same job with nothing loaded: the model built (inside ``zero.Init``) from ``job.model``'s
    weights, the ones plain PyTorch starts from, and trained."""
    import numpy as np

    from ...harness.training import gathered_params
    from . import hpz

    model, config, make_optimizer = _model(job, job.model)
    engine = hpz._initialize(job, model, config, make_optimizer)
    stale = hpz.secondary_stale(engine.module)
    losses = hpz._train(engine, job, range(job.steps))
    return {"losses": np.array(losses), "stale": np.array(stale), "params": gathered_params(engine.module)}


def _differs(job: Any, losses: Any, reference_losses: Any, params: Any, reference_params: Any) -> bool:
    from ...harness import compare

    return not (compare(losses, reference_losses, job.dtype, "losses").close
                and compare(params, reference_params, job.dtype, "params").close)


def trains_wrong(job: Any, load: str, world_size: int = 2) -> bool:
    """:func:`reproduce`'s check for ``job`` and one way to load: ``"gathered"`` or ``"checkpoint"``
    (:func:`hpz.run`), ``"grid-gathered"`` (:func:`grid_load_and_train`) or ``"none"`` (:func:`grid_train_only`).
    True if the losses or the final weights differ from plain PyTorch trained from the loaded weights."""
    import numpy as np

    from ...harness import launch, train_reference
    from . import hpz

    if load in hpz.LOADS:
        result = hpz.run(job, load, world_size)
        return _differs(job, result.losses, result.reference_losses, result.params, result.reference_params)
    results = launch(grid_load_and_train if load == "grid-gathered" else grid_train_only, world_size, job, timeout=240)
    reference = train_reference(job, world_size)
    return _differs(job, np.stack([r["losses"] for r in results]),
                    np.array(reference.losses).reshape(job.steps, world_size).T, results[0]["params"], reference.params)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), two ranks, each cell :func:`trains_wrong` (losses and weights
    against plain PyTorch from the loaded weights): ZeRO-3 with ``zero_hpz_partition_size`` 2 and the pretrained load
    (the sweep's check), the resume with ``load_checkpoint`` instead (the other use the trigger names), no load at all,
    ``zero_hpz_partition_size`` 1, and ZeRO-2 with the same load (the model built plainly: ``zero.Init`` is
    ZeRO-3's; hpZ is a ZeRO-3 setting that ZeRO-2 ignores)."""
    from ...harness import Cell, trigger_job
    from .hpz import hpz_job

    base = hpz_job()
    no_hpz = base.with_(config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    zero2 = base.with_(zero_stage=2, zero3_init=False,
                       config={"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}})

    def cell(label: str, job: Any, uses: tuple[str, ...], load: str, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, 2, uses=uses), lambda: trains_wrong(job, load), flips)

    return [cell("ZeRO-3, hpZ 2, pretrained load (GatheredParameters, modifier_rank=0)", base, ("pretrained-load",),
                 "gathered"),
            cell("resume with load_checkpoint instead of the pretrained load", base, ("checkpoint-resume",),
                 "checkpoint", "uses:pretrained-load"),
            cell("nothing loaded", base, (), "none", "uses:checkpoint-resume|uses:pretrained-load"),
            cell("zero_hpz_partition_size 1", no_hpz, ("pretrained-load",), "gathered", "hpz_partition_size"),
            cell("ZeRO-2 instead, the same load", zero2, ("pretrained-load",), "grid-gathered", "zero_stage")]
