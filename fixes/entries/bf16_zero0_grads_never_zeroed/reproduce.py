"""How bf16-zero0-grads-never-zeroed is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix
or its probe.

``user_script()`` is one rank of a user's training script (what the ``deepspeed`` launcher starts on each rank);
``bf16_ddp_reference()`` is plain PyTorch data parallelism of the same bf16 model, as torch DDP runs a bf16
model: :func:`fixes.harness.train_reference` with ``grad_dtype=torch.bfloat16`` (bf16 gradients, accumulated
in bf16 over micro-batches, averaged over the ranks in bf16, then an optimizer step on fp32 master weights).
"""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

WORLD_SIZE = 2
FP16_OPTIMIZERS = ("FP16_UnfusedOptimizer", "FP16_Optimizer")


def bf16_zero0_job(**changes: Any) -> Any:
    """The harness job of this entry: bf16 without ZeRO and without fp32 gradient accumulation (the default),
    SGD; the ``fp16`` block disabled so DeepSpeed's defaults apply, as in a user's bf16 config."""
    from ...harness import Job

    return Job(zero_stage=0, dtype="bfloat16", optimizer="sgd", lr=0.1, steps=3,
               config={"fp16": {"enabled": False}}).with_(**changes)


def user_script(job: Any) -> dict[str, Any]:
    """One rank: ``deepspeed.initialize`` with the job's config, then ``engine(x)``, ``engine.backward(loss)``,
    ``engine.step()`` on this rank's shard of every micro-batch. Returns the optimizer's class name and loss
    scale, per step the gradient norm DeepSpeed reports and whether the model still holds gradients after
    ``engine.step()``, and the trained parameters (fp32)."""
    import torch

    from ...harness import build_engine, device, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    engine = build_engine(job)  # deepspeed.initialize(model=TinyMLP(), optimizer=SGD/Adam, config=ds_config(job))
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = dtype_of(job.dtype)
    batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
    loss_scale = getattr(engine.optimizer, "cur_scale", None)
    grad_norms, grads_left = [], []
    for step in range(job.steps):
        for micro in range(job.micro_steps):
            x, y = batches.micro(step, micro, rank)
            loss = mse(engine(x.to(device(), dtype)), y.to(device()))
            engine.backward(loss)
            engine.step()
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
        grads_left.append(any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in engine.module.parameters()))
    return {"optimizer": type(engine.optimizer).__name__, "loss_scale": None if loss_scale is None else float(loss_scale),
            "grad_norms": grad_norms, "grads_left_after_step": grads_left, "params": gathered_params(engine.module)}


def bf16_ddp_reference(job: Any, world_size: int = WORLD_SIZE, initial_zero_step: bool = False) -> Any:
    """Plain PyTorch data parallelism of the job's bf16 model on ``world_size`` shards, as torch DDP (and
    DeepSpeed's default all-reduce) run it: :func:`fixes.harness.train_reference` with
    ``grad_dtype=torch.bfloat16``. ``initial_zero_step``: one optimizer step on zero gradients first, as
    FP16_UnfusedOptimizer does when it is built (Adam's step count starts one ahead; SGD is unchanged)."""
    import torch

    from ...harness import train_reference

    return train_reference(job, world_size, initial_zero_step=initial_zero_step, grad_dtype=torch.bfloat16)


def run_two_ranks(job: Any, timeout: float = 180.0) -> list[dict[str, Any]]:
    """``user_script(job)`` on two gloo ranks, each with its own shard of the data."""
    from ...harness import launch

    return launch(user_script, WORLD_SIZE, job, timeout=timeout)


def versus(label: str, job: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's trained parameters and reported gradient norms against :func:`bf16_ddp_reference` (with
    FP16_UnfusedOptimizer's initial zero step where the engine built one), with the bf16 tolerance."""
    from ...harness import compare

    result = ranks[0]
    reference = bf16_ddp_reference(job, initial_zero_step=result["optimizer"] == "FP16_UnfusedOptimizer")
    params = compare(result["params"], reference.params, job.dtype, f"{label}: parameters vs plain data parallel")
    norms = compare(result["grad_norms"], reference.grad_norms, job.dtype, f"{label}: gradient norms vs plain data parallel")
    return {"label": label, "ranks": ranks, "reference": reference, "params": params, "grad_norms": norms,
            "close": params.close and norms.close}


def reproduce() -> bool:
    """Two ranks, bf16 ZeRO-0 SGD, two steps: True if the trained parameters or the reported gradient norms
    differ from plain-PyTorch data parallelism beyond the bf16 tolerance."""
    job = bf16_zero0_job(steps=2)
    ranks = run_two_ranks(job)
    optimizers = {rank["optimizer"] for rank in ranks}
    if not optimizers <= {*FP16_OPTIMIZERS, "BF16_Optimizer"}:
        raise CannotTellError(f"bf16 without ZeRO built {', '.join(sorted(optimizers))}")
    return not versus("bf16 ZeRO-0, SGD", job, ranks)["close"]


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path). Sixteen
    micro-batches per step: the issue's 50 ms floor for a timed step (docs/performance.md shows the step time)."""
    from ... import harness

    return harness.bench_job(zero_stage=0, dtype="bfloat16", micro_steps=16, config={"fp16": {"enabled": False}})


def differs_from_data_parallel(job: Any, world_size: int = WORLD_SIZE) -> bool:
    """``user_script(job)`` on ``world_size`` ranks against plain-PyTorch data parallelism with gradients in the
    job's dtype (:func:`fixes.harness.train_reference`, with FP16_UnfusedOptimizer's initial zero step where the
    engine built one): True if rank 0's parameters, or the gradient norms DeepSpeed reports (where it reports
    them), differ beyond the job's dtype tolerance."""
    from ...harness import compare, launch, train_reference
    from ...harness.compare import dtype_of

    result = launch(user_script, world_size, job)[0]
    reference = train_reference(job, world_size, initial_zero_step=result["optimizer"] == "FP16_UnfusedOptimizer",
                                grad_dtype=dtype_of(job.dtype))
    close = compare(result["params"], reference.params, job.dtype).close
    if None not in result["grad_norms"]:  # a client optimizer without DeepSpeed's wrapper reports none
        close = close and compare(result["grad_norms"], reference.grad_norms, job.dtype).close
    return not close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): bf16 without ZeRO (bf16 gradient accumulation, the default),
    SGD, two steps, on two ranks (the sweep's check) and on one, then each condition flipped on its own: fp32 (not
    fp16, which has its own ZeRO-0 bug, fp16-zero0-loss-scale), ZeRO-1, and ``grad_accum_dtype`` fp32. The last
    cell applies bf16-gets-fp16-optimizer's fix in its rank: without it the reproduce release sends bf16 with fp32
    accumulation to the same FP16_UnfusedOptimizer through that entry's bug (and its gradients are never zeroed
    either); with it the engine builds BF16_Optimizer, which on two ranks meets bf16-zero1-last-microbatch-allreduce
    (nothing all-reduced with gas=1), so that cell runs on one rank. Each cell trains against plain-PyTorch data
    parallelism in the job's dtype (:func:`differs_from_data_parallel`)."""
    from ...harness import Cell, trigger_job

    def cell(label: str, job: Any, world_size: int = WORLD_SIZE, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, world_size), lambda: differs_from_data_parallel(job, world_size), flips)

    base = bf16_zero0_job(steps=2)
    fp32_accumulation = base.with_(config={"fp16": {"enabled": False}, "data_types": {"grad_accum_dtype": "fp32"}},
                                   fixes=("bf16-gets-fp16-optimizer",))
    return [cell("bf16, ZeRO stage 0, two ranks", base),
            cell("bf16, ZeRO stage 0, one rank", base, 1),
            cell("fp32 instead", base.with_(dtype="float32"), flips="precision"),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), flips="zero_stage"),
            cell("grad_accum_dtype fp32 (BF16_Optimizer, bf16-gets-fp16-optimizer's fix applied), one rank",
                 fp32_accumulation, 1, "grad_accum_dtype")]
