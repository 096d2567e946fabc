"""How zero3-allreduce-fetch-padded-params is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. The run itself is in ``fetch.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce(dtype: str = "float32") -> bool:
    """Two ranks, ZeRO-3 with ``stage3_use_all_reduce_for_fetch_params``, a model whose every parameter is
    padded, and PyTorch's ``torch.use_deterministic_algorithms(True, warn_only=True)`` (uninitialised memory
    filled with NaN, so the padding's contents are the same in every run). True if the first forward computes
    with weights other than the model's, or the losses or final weights differ from plain PyTorch data
    parallelism (beyond ``TOLERANCES``). One launch of two ranks."""
    import torch

    from .fetch import fetch_job

    if not hasattr(getattr(torch.utils, "deterministic", None), "fill_uninitialized_memory"):
        raise CannotTellError(f"torch {torch.__version__} does not fill uninitialised memory under "
                              "use_deterministic_algorithms (torch >= 2.1 does): what the padding holds would "
                              "depend on the allocator")
    return padding_shows(fetch_job(dtype))


def padding_shows(job: Any, world_size: int | None = None) -> bool:
    """:func:`reproduce`'s check of ``job`` on ``world_size`` ranks (:data:`~.fetch.WORLD_SIZE` by default): the
    user's script (:func:`~.fetch.train`, deterministic) next to plain PyTorch data parallelism on the same shards.
    True if the first forward computes with weights other than the model's, or the losses or final weights
    differ from plain PyTorch."""
    import numpy as np

    from ...exceptions import RankFailedError
    from ...harness.launch import launch
    from ...harness.training import train_reference
    from . import fetch_wait_raises
    from .fetch import WORLD_SIZE, FetchRun, run, train

    try:
        if world_size is None or world_size == WORLD_SIZE:
            result = run(job)
        else:
            results = launch(train, world_size, job, True, timeout=180)
            reference = train_reference(job, world_size)
            result = FetchRun(job, np.stack([r["losses"] for r in results]),
                              np.array(reference.losses).reshape(job.steps, world_size).T, results[0]["params"],
                              reference.params, results[0]["built"], tuple(r["seen"] for r in results))
    except RankFailedError as exc:
        if "handle_dependency" in exc.message and fetch_wait_raises():
            raise CannotTellError("a training job with stage3_use_all_reduce_for_fetch_params cannot run on this "
                                  f"release: its first fetch raises {exc.exc_type}: {exc.message} (upstream PR "
                                  "#7414), before any fetched value is used") from exc
        raise
    return any(result.wrong) or not result.matches_reference


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`padding_shows` (the sweep's check: the
    user's script under ``torch.use_deterministic_algorithms``, every parameter of the model padded, next to plain
    PyTorch): ZeRO-3 with ``stage3_use_all_reduce_for_fetch_params`` on two ranks, then the option off (the
    all_gather fetch), ZeRO-2 instead with the option still in the config (only ZeRO-3 fetches parameters), and
    one rank (nothing is padded). On this release ZeRO-2 on two CPU ranks runs (zero12-flat-buffer-detach's
    error is fixed here), so the stage flip is ZeRO-2. What no condition reads, a parameter whose element count
    is not a multiple of the rank count, is the trigger's note: every cell uses the same padded model."""
    from ...harness import Cell, trigger_job
    from .fetch import WORLD_SIZE, fetch_job

    base = fetch_job()
    zero = dict(base.config["zero_optimization"])

    def cell(label: str, job: Any, world_size: int = WORLD_SIZE, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, world_size), lambda: padding_shows(job, world_size), flips)

    return [cell("ZeRO-3, stage3_use_all_reduce_for_fetch_params, two ranks, padded parameters", base),
            cell("stage3_use_all_reduce_for_fetch_params false",
                 base.with_(config={"zero_optimization": {**zero, "stage3_use_all_reduce_for_fetch_params": False}}),
                 flips="all_reduce_fetch_params"),
            cell("ZeRO-2 instead", base.with_(zero_stage=2, config={"zero_optimization": {**zero, "stage": 2}}),
                 flips="zero_stage"),
            cell("one rank", base, 1, "world_size")]
