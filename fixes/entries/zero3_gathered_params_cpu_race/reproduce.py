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
