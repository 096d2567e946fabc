"""How zero1-fp32-grad-accum-not-reduced is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe.

``user_script()`` is one rank of a user's training script (what the ``deepspeed`` launcher starts on each rank);
``reference_fp32_grads()`` is the gradient plain-PyTorch data parallelism steps on, and ``local_fp32_grads()`` the
one a rank steps on where nothing is averaged: its own shard's gradient alone.
"""
from __future__ import annotations

import contextlib
import copy
from typing import Any

from ...exceptions import CannotTellError

WORLD_SIZE = 2
OPTIMIZER = "DeepSpeedZeroOptimizer"  # the optimizer the bug lives in
GRAD_ACCUM_FP32 = {"data_types": {"grad_accum_dtype": "fp32"}}
# Entry zero12-flat-buffer-detach: where it is installed, two ZeRO-1/2 CPU ranks fail at the first step before any
# gradient is reduced. Its fix is applied in the ranks (a no-op where that bug is absent).
UNMASK = ("zero12-flat-buffer-detach",)
# Entry zero12-cpu-no-allreduce-noncontiguous: with contiguous_gradients false, CPU ranks reduce nothing at all (by
# another fault); the grid's cell with contiguous_gradients false applies its fix in the ranks too.
UNMASK_NONCONTIGUOUS = (*UNMASK, "zero12-cpu-no-allreduce-noncontiguous")


def zero1_job(dtype: str = "bfloat16", offload: bool = True, **changes: Any) -> Any:
    """The harness job of this entry: ZeRO stage 1 with ``data_types.grad_accum_dtype: fp32``, bf16 with
    ``offload_optimizer`` to CPU by default (the configuration the engine builds DeepSpeedZeroOptimizer for under
    bf16; fp16 gets it with or without offload), one micro-batch per step, SGD, two steps, with :data:`UNMASK`
    applied in the ranks."""
    from ...harness import Job

    return Job(zero_stage=1, dtype=dtype, offload=offload, config=GRAD_ACCUM_FP32, fixes=UNMASK).with_(**changes)


def user_script(job: Any) -> dict[str, Any]:
    """One rank: ``deepspeed.initialize`` with the job's config, then ``engine(x)``, ``engine.backward(loss)``,
    ``engine.step()`` on this rank's shard of every micro-batch. A step pre-hook on the torch optimizer
    (``engine.basic_optimizer``) copies the fp32 gradient it is about to step on (under ZeRO-1 this rank's
    partition, flattened in ``param_groups`` order). Returns the optimizer's class name, that gradient per step, the
    model's parameter count and the trained parameters (fp32)."""
    import io

    import numpy as np
    import torch

    from ...harness import build_engine, device, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    with contextlib.redirect_stdout(io.StringIO()):  # the optimizer's set-up report stays in the rank
        engine = build_engine(job)  # deepspeed.initialize(model=TinyMLP(), optimizer=SGD, config=ds_config(job))
    stepped: list[Any] = []

    def capture(optimizer: Any, *_: Any) -> None:
        stepped.append(np.concatenate([param.grad.detach().float().reshape(-1).cpu().numpy()
                                       for group in optimizer.param_groups for param in group["params"]]))

    engine.basic_optimizer.register_step_pre_hook(capture)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = dtype_of(job.dtype)
    batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
    for step in range(job.steps):
        for micro in range(job.micro_steps):
            x, y = batches.micro(step, micro, rank)
            loss = mse(engine(x.to(device(), dtype)), y.to(device()))
            engine.backward(loss)
            engine.step()
    return {"optimizer": type(engine.optimizer).__name__, "grads": stepped,
            "numel": sum(param.numel() for param in engine.module.parameters()),
            "params": gathered_params(engine.module)}


def _first_step_grads(job: Any, world_size: int, ranks: tuple[int, ...], average: bool) -> dict[str, Any]:
    """Plain PyTorch, the first step's gradient by parameter name (fp32): the micro-batch gradients of each of
    ``ranks``' shards (each micro-loss divided by gas) summed in fp32; with ``average``, the shards' sums converted
    to the job's dtype, summed over the shards in that dtype and times ``1/len(ranks)`` (DeepSpeed's all-reduce in
    its default communication dtype); without, the one shard's fp32 sum."""
    import torch

    from ...harness import TinyMLP, make_batches, mse
    from ...harness.compare import dtype_of
    from ...harness.training import original_functional_linear

    dtype = dtype_of(job.dtype)
    batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
    with original_functional_linear():
        work = copy.deepcopy(TinyMLP(job.model)).to(dtype)
        names = [name for name, _ in work.named_parameters()]
        sums = {rank: {name: torch.zeros_like(param, dtype=torch.float32) for name, param in work.named_parameters()}
                for rank in ranks}
        for micro in range(job.micro_steps):
            for rank in ranks:
                x, y = batches.micro(0, micro, rank)
                loss = mse(work(x.to(dtype)), y) / job.micro_steps
                for name, grad in zip(names, torch.autograd.grad(loss, list(work.parameters()))):
                    sums[rank][name] += grad.float()
    grads = {}
    for name in names:
        if not average:
            grads[name] = sums[ranks[0]][name]
            continue
        total = sums[ranks[0]][name].to(dtype)
        for rank in ranks[1:]:  # the all-reduce's sum, in the communication dtype
            total = (total.float() + sums[rank][name].to(dtype).float()).to(dtype)
        grads[name] = (total * (1.0 / len(ranks))).float()
    return {name: grad.numpy() for name, grad in grads.items()}


def reference_fp32_grads(job: Any, world_size: int = WORLD_SIZE) -> dict[str, Any]:
    """Plain-PyTorch data parallelism on ``world_size`` shards, the first step's gradient by parameter name (fp32):
    each shard's micro-batch gradients summed in fp32 (fp32 gradient accumulation), then averaged over the shards in
    the job's dtype (``communication_data_type``'s default)."""
    return _first_step_grads(job, world_size, tuple(range(world_size)), average=True)


def local_fp32_grads(job: Any, rank: int, world_size: int = WORLD_SIZE) -> dict[str, Any]:
    """The bug's arithmetic: rank ``rank``'s own shard's first-step gradient, summed in fp32 over its micro-batches
    and averaged with nothing."""
    return _first_step_grads(job, world_size, (rank,), average=False)


def flat(grads: dict[str, Any]) -> Any:
    """Gradients by parameter name as one flat vector, in the model's parameter order (ZeRO's flat buffer order)."""
    import numpy as np

    return np.concatenate([grad.reshape(-1) for grad in grads.values()])


def stepped_gradient(ranks: list[dict[str, Any]], step: int = 0) -> Any:
    """The whole fp32 gradient the ranks' torch optimizers stepped on at ``step``: the ranks' partitions put
    together (ZeRO-1 partitions the flat buffer in rank order), without the padding; or rank 0's own where one rank
    holds all of it."""
    import numpy as np

    numel = ranks[0]["numel"]
    if ranks[0]["grads"][step].size >= numel:
        return ranks[0]["grads"][step][:numel]
    return np.concatenate([rank["grads"][step] for rank in ranks])[:numel]


def partition_slices(ranks: list[dict[str, Any]], step: int = 0) -> list[tuple[int, int]]:
    """(start, stop) of each rank's partition in the flat gradient, without the padding."""
    numel, slices, start = ranks[0]["numel"], [], 0
    for rank in ranks:
        stop = min(start + rank["grads"][step].size, numel)
        slices.append((start, stop))
        start = stop
    return slices


def run_ranks(job: Any, world_size: int = WORLD_SIZE, timeout: float = 180.0) -> list[dict[str, Any]]:
    """``user_script(job)`` on ``world_size`` gloo ranks, each with its own shard of the data; raises
    CannotTellError where the engine did not build DeepSpeedZeroOptimizer (the bug lives there)."""
    from ...harness import launch

    ranks = launch(user_script, world_size, job, timeout=timeout)
    optimizers = {rank["optimizer"] for rank in ranks}
    if optimizers != {OPTIMIZER}:
        raise CannotTellError(f"ZeRO-1 with fp32 gradient accumulation built {', '.join(sorted(optimizers))}, "
                              f"not {OPTIMIZER}")
    return ranks


def stepped_gradient_differs(job: Any, world_size: int = WORLD_SIZE, expect_optimizer: bool = True) -> bool:
    """``job``'s first step on ``world_size`` ranks: True if the fp32 gradient the torch optimizers step on (the
    ranks' partitions put together) differs from plain-PyTorch data parallelism's beyond the job's dtype
    tolerance. With ``expect_optimizer`` False (a flipped cell), any optimizer the engine builds is measured; a
    difference there raises CannotTellError unless the engine built DeepSpeedZeroOptimizer (another optimizer's
    difference would be another fault)."""
    from ...harness import compare, launch

    if expect_optimizer:
        ranks = run_ranks(job, world_size)
    else:
        ranks = launch(user_script, world_size, job, timeout=180.0)
    differs = not compare(stepped_gradient(ranks), flat(reference_fp32_grads(job, world_size)), job.dtype).close
    optimizers = {rank["optimizer"] for rank in ranks}
    if differs and optimizers != {OPTIMIZER}:
        raise CannotTellError(f"the stepped gradient differs from data parallelism's, but the engine built "
                              f"{', '.join(sorted(optimizers))}, not {OPTIMIZER}, where this bug lives")
    return differs


def reproduce() -> bool:
    """Two ranks, bf16 with fp32 gradient accumulation, ZeRO-1 with offload_optimizer to CPU, one micro-batch, one
    SGD step: True if the fp32 gradient the ranks step on differs from plain-PyTorch data parallelism's beyond the
    bf16 tolerance."""
    return stepped_gradient_differs(zero1_job(steps=1))


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path: every gradient
    reduced at ZeRO-1 with fp32 accumulation goes through it): bf16 with offload_optimizer to CPU, four
    micro-batches per step."""
    from ... import harness

    return harness.bench_job(zero_stage=1, dtype="bfloat16", offload=True, micro_steps=4, config=GRAD_ACCUM_FP32)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): ZeRO-1 with ``grad_accum_dtype`` fp32 on two ranks, one SGD
    step, in each configuration the engine builds DeepSpeedZeroOptimizer for (bf16 with ``offload_optimizer`` to
    CPU, gas 1 and gas 4; fp16 without and with offload; with ``overlap_comm`` true; with
    ``contiguous_gradients`` false), then each condition flipped on its own from the bf16 + offload job: fp32, the
    default (model-dtype) gradient accumulation, bf16 without offload (the engine builds BF16_Optimizer), ZeRO-2,
    one rank. Each cell compares the fp32 gradient the torch optimizer steps on with plain-PyTorch data
    parallelism's (:func:`stepped_gradient_differs`).

    Every job applies zero12-flat-buffer-detach's fix in its ranks (:data:`UNMASK`, a no-op on the reproduce
    release); the cell with ``contiguous_gradients`` false also applies zero12-cpu-no-allreduce-noncontiguous's
    (:data:`UNMASK_NONCONTIGUOUS`), whose bug on the CPU accelerator reduces nothing on that path whatever the
    dtype. No cell for ZeRO stage 0 (the engine refuses fp16 with fp32 accumulation there and builds
    BF16_Optimizer for bf16) or ZeRO-3 (another optimizer)."""
    from ...harness import Cell, trigger_job

    def cell(label: str, job: Any, world_size: int = WORLD_SIZE, flips: str = "", same_optimizer: bool = True) -> Cell:
        return Cell(label, trigger_job(job, world_size),
                    lambda: stepped_gradient_differs(job, world_size, expect_optimizer=same_optimizer), flips)

    base = zero1_job(steps=1)

    def zero(**values: Any) -> dict[str, Any]:
        return {**GRAD_ACCUM_FP32, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}, **values}}

    return [cell("bf16, offload_optimizer to CPU, grad_accum_dtype fp32, ZeRO-1, two ranks, gas 1", base),
            cell("the same with gas 4", base.with_(micro_steps=4)),
            cell("fp16 without offload", base.with_(dtype="float16", offload=False)),
            cell("fp16 with offload", base.with_(dtype="float16")),
            cell("with overlap_comm true", base.with_(config=zero(overlap_comm=True))),
            cell("with contiguous_gradients false", base.with_(config=zero(contiguous_gradients=False),
                                                                fixes=UNMASK_NONCONTIGUOUS)),
            cell("fp32 instead", base.with_(dtype="float32"), flips="precision", same_optimizer=False),
            cell("the default gradient accumulation dtype (bf16)", base.with_(config={}), flips="grad_accum_dtype"),
            cell("bf16 without offload (BF16_Optimizer)", base.with_(offload=False), flips="offload_optimizer",
                 same_optimizer=False),
            cell("ZeRO-2 instead", base.with_(zero_stage=2), flips="zero_stage"),
            cell("one rank", base, 1, "world_size")]
