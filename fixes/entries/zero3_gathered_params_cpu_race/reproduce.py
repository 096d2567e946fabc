"""How zero3-gathered-params-cpu-race is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. ``user_script()`` is the user's training script the notebook runs on two ranks, and
``reference_trajectory()`` the plain-PyTorch parameters after every step that its copies are compared with."""
from __future__ import annotations

from typing import Any

import numpy as np


def reproduce() -> bool:
    """Two ranks train a ZeRO-3 TinyMLP for 200 steps, gathering the whole model after each step
    all at once and one parameter at a time (no fix applied), up to three times. True if any
    all-at-once gather differs from the one-at-a-time gather on any rank."""
    from .gathering import gather_job, run_until_corrupt

    return any(run.corrupt for run in run_until_corrupt(gather_job())[-1])


def user_script(config: dict[str, Any], steps: int) -> dict[str, Any]:
    """One rank of a user's ZeRO-3 training script (what the ``deepspeed`` launcher starts on each
    rank) that keeps a full copy of the weights after every step, to log, average or save them: the
    model built inside ``deepspeed.zero.Init``, ``deepspeed.initialize`` with ``config``, then
    ``engine(x)``, ``engine.backward(loss)``, ``engine.step()`` and one ``GatheredParameters`` over
    all parameters. Returns the copies, stacked per parameter (``[steps, ...]``)."""
    import deepspeed
    import torch

    from ...harness import ModelSpec, TinyMLP, device, make_batches, mse

    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TinyMLP()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = make_batches(ModelSpec(), steps, world_size=world_size)
    copies = []
    for step in range(steps):
        x, y = batches.micro(step, 0, rank)
        loss = mse(engine(x.to(device())), y.to(device()))
        engine.backward(loss)
        engine.step()
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            copies.append({name: p.detach().clone() for name, p in model.named_parameters()})
    return {name: torch.stack([copy[name] for copy in copies]) for name in copies[0]}


def reference_trajectory(job: Any, world_size: int = 2) -> dict[str, np.ndarray]:
    """Plain-PyTorch data parallelism for ``job`` (fp32, SGD, one micro-batch per step, each rank's
    shard of the batch, gradients averaged): the parameters after every step, stacked per parameter
    (``[steps, ...]``). Its last step is ``harness.train_reference(job, world_size).params`` (the
    notebook checks it)."""
    import torch

    from ...harness import TinyMLP, make_batches, mse, original_functional_linear

    if (job.dtype, job.optimizer, job.micro_steps, job.backwards) != ("float32", "sgd", 1, 1):
        raise ValueError("reference_trajectory models fp32 SGD with one backward per step only")
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)
    trajectory = []
    with original_functional_linear():
        model = TinyMLP(job.model)
        optimizer = torch.optim.SGD(model.parameters(), lr=job.lr)
        for step in range(job.steps):
            optimizer.zero_grad()
            for rank in range(world_size):
                x, y = batches.micro(step, 0, rank)
                (mse(model(x), y) / world_size).backward()
            optimizer.step()
            trajectory.append({name: p.detach().numpy().copy() for name, p in model.named_parameters()})
    return {name: np.stack([after[name] for after in trajectory]) for name in trajectory[0]}


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path:
    every ZeRO-3 forward and backward goes through it)."""
    from ... import harness

    return harness.bench_job(zero_stage=3, zero3_init=True)


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def grid_script(config: dict[str, Any], steps: int, all_at_once: bool = True) -> dict[str, Any]:
    """:func:`user_script` as a trigger cell varies it: the model built inside ``deepspeed.zero.Init`` only where
    ``config`` is ZeRO-3 (a script of another stage builds it plainly), and the copy made with one
    ``GatheredParameters`` over all parameters (``all_at_once``) or one per parameter
    (``fixes.zero3.gathered_parameters``)."""
    import contextlib

    import deepspeed
    import torch

    from ...harness import ModelSpec, TinyMLP, device, make_batches, mse
    from ...zero3 import gathered_parameters

    zero3 = config["zero_optimization"]["stage"] == 3
    with deepspeed.zero.Init(config_dict_or_path=config) if zero3 else contextlib.nullcontext():
        model = TinyMLP()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    batches = make_batches(ModelSpec(), steps, world_size=world_size)
    copies = []
    for step in range(steps):
        x, y = batches.micro(step, 0, rank)
        loss = mse(engine(x.to(device())), y.to(device()))
        engine.backward(loss)
        engine.step()
        if all_at_once:
            with deepspeed.zero.GatheredParameters(list(model.parameters())):
                copies.append({name: p.detach().clone() for name, p in model.named_parameters()})
        else:
            with gathered_parameters(model) as params:
                copies.append({name: p.clone() for name, p in params.items()})
    return {name: torch.stack([copy[name] for copy in copies]) for name in copies[0]}


def copies_go_wrong(world_size: int = 2, all_at_once: bool = True, zero_stage: int = 3, steps: int = 200,
                    attempts: int = 3, timeout: float = 300) -> bool:
    """The notebook's check: :func:`user_script` (any other ``zero_stage`` or ``all_at_once``: :func:`grid_script`)
    on ``world_size`` ranks, up to ``attempts`` runs of ``steps`` steps; True at the first run in which any rank's
    copy after a step differs from plain PyTorch after the same step (:func:`reference_trajectory`) beyond the fp32
    tolerance."""
    from ...harness import compare, ds_config, launch

    job = grid_job(zero_stage, steps=steps)
    config = ds_config(job, world_size)
    reference = reference_trajectory(job, world_size)
    for _ in range(attempts):
        if zero_stage == 3 and all_at_once:
            ranks = launch(user_script, world_size, config, steps, timeout=timeout)
        else:
            ranks = launch(grid_script, world_size, config, steps, all_at_once, timeout=timeout)
        for copies in ranks:
            if any(not compare({name: c[k] for name, c in copies.items()},
                               {name: r[k] for name, r in reference.items()}, job.dtype).close for k in range(steps)):
                return True
    return False


def grid_job(zero_stage: int = 3, **changes: Any) -> Any:
    """The sweep's job (:func:`gathering.gather_job`); with another ``zero_stage``, that stage without
    ``deepspeed.zero.Init``."""
    from .gathering import gather_job

    if zero_stage == 3:
        return gather_job(**changes)
    return gather_job(zero_stage=zero_stage, zero3_init=False, config={"zero_optimization": {"stage": zero_stage}},
                      **changes)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell the notebook's check (:func:`copies_go_wrong`: the
    user's script keeps a copy of the whole model after each of 200 steps, compared with plain PyTorch; up to three
    runs): two ranks on CPU with one ``GatheredParameters`` over all parameters, then one rank, one
    ``GatheredParameters`` per parameter, and ZeRO stage 0 (the model built without ``zero.Init``;
    ``GatheredParameters`` over parameters that are not partitioned does nothing). The stage flip is ZeRO-0, not
    ZeRO-1/2: on two CPU ranks this release's ZeRO-1/2 fail at the first step with entry
    zero12-flat-buffer-detach's error. The accelerator is not flipped: CUDA is not on this machine."""
    from ...harness import Cell, trigger_job

    job = grid_job()
    return [Cell("ZeRO-3, 2 ranks on CPU, one GatheredParameters over all parameters",
                 trigger_job(job, 2, uses=("gathered-parameters",)), lambda: copies_go_wrong(2)),
            Cell("one rank", trigger_job(job, 1, uses=("gathered-parameters",)), lambda: copies_go_wrong(1),
                 "world_size"),
            Cell("one GatheredParameters per parameter", trigger_job(job, 2),
                 lambda: copies_go_wrong(2, all_at_once=False), "uses:gathered-parameters"),
            Cell("ZeRO stage 0 instead", trigger_job(grid_job(0), 2, uses=("gathered-parameters",)),
                 lambda: copies_go_wrong(2, zero_stage=0), "zero_stage")]
