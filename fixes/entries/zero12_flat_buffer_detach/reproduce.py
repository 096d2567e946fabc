"""How zero12-flat-buffer-detach is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe. ``user_script()`` is the user's training script the notebook runs on two ranks."""
from __future__ import annotations

from typing import Any


def reproduce() -> bool:
    """Build a one-rank ZeRO-1 engine and look at its flat fp32/bf16 buffer: an autograd graph on
    it (``grad_fn``) is what makes two ranks fail at the first step."""
    from ...harness import Job, build_engine

    optimizer = build_engine(Job(zero_stage=1)).optimizer
    return any(buffer.grad_fn is not None for buffer in optimizer.bit16_groups_flat)


def user_script(config: dict[str, Any], steps: int = 2) -> dict[str, Any]:
    """One rank of a user's ZeRO-1/2 training script (what the ``deepspeed`` launcher starts on each
    rank): ``deepspeed.initialize`` with ``config``, then ``steps`` steps of ``engine(x)``,
    ``engine.backward(loss)``, ``engine.step()`` on this rank's shard of the data. Returns the trained
    parameters (gathered, fp32) for the comparison with plain PyTorch."""
    import deepspeed
    import torch

    from ...harness import ModelSpec, TinyMLP, device, gathered_params, make_batches, mse

    model = TinyMLP()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=config)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = torch.bfloat16 if config["bf16"]["enabled"] else torch.float32
    batches = make_batches(ModelSpec(), steps, world_size=world_size)
    for step in range(steps):
        x, y = batches.micro(step, 0, rank)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        engine.step()  # the first step raises where the flat buffer keeps its graph
    return gathered_params(engine.module)
