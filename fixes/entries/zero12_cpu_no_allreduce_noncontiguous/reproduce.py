"""How zero12-cpu-no-allreduce-noncontiguous is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. ``probe_in_rank()`` is the probe as a launched rank answers it (ranks run on CPU where there
are fewer GPUs than ranks). The notebook runs the user's script, ``harness.data_parallel_script``, on two ranks."""
from __future__ import annotations

from typing import Any

# Entry zero12-flat-buffer-detach: where ZeRO-1/2's flat buffer keeps an autograd graph, two ranks fail at the
# first step before any gradient is reduced. Its fix is applied in the ranks (a no-op where that bug is absent).
UNMASK = ("zero12-flat-buffer-detach",)


def noncontiguous_job(stage: int = 1, dtype: str = "float32", **changes: Any) -> Any:
    """The user's job: ZeRO ``stage`` with ``contiguous_gradients: false``, SGD, two steps (``Job``'s
    defaults), with :data:`UNMASK` applied in the ranks."""
    from ...harness import Job

    return Job(zero_stage=stage, dtype=dtype, fixes=UNMASK,
               config={"zero_optimization": {"stage": stage, "contiguous_gradients": False}}).with_(**changes)


def two_ranks_versus_reference(job: Any, timeout: float = 180) -> tuple[Any, Any]:
    """``job`` on two ranks (each its own shard of every batch) and plain-PyTorch data parallelism over
    the same shards: (comparison of rank 0's parameters with the reference, comparison of rank 1's
    with rank 0's)."""
    from ...harness import compare, launch, run_job, train_reference

    ranks = launch(run_job, 2, job, timeout=timeout)
    reference = train_reference(job, world_size=2)
    return (compare(ranks[0].params, reference.params, job.dtype, f"ZeRO-{job.zero_stage} {job.dtype}: 2 ranks vs plain PyTorch"),
            compare(ranks[1].params, ranks[0].params, "float32", f"ZeRO-{job.zero_stage} {job.dtype}: rank 1 vs rank 0"))



def probe_in_rank() -> dict[str, Any]:
    """What a launched rank runs on and what this entry's probe says there (for
    :func:`fixes.harness.launch`): ``{"accelerator": ..., "affected": ...}``."""
    from deepspeed.accelerator import get_accelerator

    from . import FIX

    return {"accelerator": get_accelerator().device_name(), "affected": FIX.probe().affected}


def reproduce() -> bool:
    """ZeRO-1, ``contiguous_gradients: false``, fp32, two ranks with different data, one step, against
    plain-PyTorch data parallelism: True if the parameters differ beyond the fp32 tolerance."""
    versus, _ = two_ranks_versus_reference(noncontiguous_job(stage=1, steps=1))
    return not versus.close


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path: every
    reduction with contiguous_gradients false goes through it). Four micro-batches per step: one reduction
    each, and a step over the issue's 50 ms floor (docs/performance.md shows the step time)."""
    from ... import harness

    return harness.bench_job(zero_stage=2, micro_steps=4,
                             config={"zero_optimization": {"stage": 2, "contiguous_gradients": False}})


def ranks_differ_from_reference(job: Any, world_size: int, timeout: float = 180) -> bool:
    """``job`` on ``world_size`` ranks (each its own shard of every batch) against plain-PyTorch data parallelism
    over the same shards: True if rank 0's parameters differ beyond the job's dtype tolerance."""
    from ...harness import compare, launch, run_job, train_reference

    ranks = launch(run_job, world_size, job, timeout=timeout)
    return not compare(ranks[0].params, train_reference(job, world_size=world_size).params, job.dtype).close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ZeRO-1 with ``contiguous_gradients: false`` on two CPU ranks,
    ZeRO-2 likewise (every condition too), then each condition flipped on its own: ZeRO stage 0 (not ZeRO-3, whose
    gather on gloo meets zero3-gathered-params-cpu-race on the reproduce release), ``contiguous_gradients: true``,
    one rank. Each cell is the sweep's check (one SGD step against plain-PyTorch data parallelism, fp32 tolerance).
    The CPU accelerator is not flipped: CUDA ranks need GPUs this grid does not have."""
    from ...harness import Cell, trigger_job

    def cell(label: str, job: Any, world_size: int = 2, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, world_size), lambda: ranks_differ_from_reference(job, world_size), flips)

    base = noncontiguous_job(stage=1, steps=1)
    contiguous = base.with_(config={"zero_optimization": {"stage": 1, "contiguous_gradients": True}})
    return [cell("ZeRO-1, contiguous_gradients false, two CPU ranks", base),
            cell("ZeRO-2, contiguous_gradients false, two CPU ranks", noncontiguous_job(stage=2, steps=1)),
            cell("ZeRO stage 0 instead", noncontiguous_job(stage=0, steps=1), flips="zero_stage"),
            cell("contiguous_gradients true", contiguous, flips="contiguous_gradients"),
            cell("one rank", base, world_size=1, flips="world_size")]
