"""A user's training loop for entries whose model is their own (a wrapper, experts, a decoder), one micro-batch per
step on the harness's batches: through a DeepSpeed engine, and in plain PyTorch as the reference."""
from __future__ import annotations

import copy
from typing import Any, Callable, Iterable

import torch

from .compare import dtype_of
from .env import device
from .models import make_batches, mse
from .training import TrainResult, original_functional_linear


def engine_steps(engine: Any, batches: Any, steps: int, dtype: torch.dtype,
                 before_step: Callable[[int], None] | None = None) -> list[float]:
    """For each step: ``before_step(step)`` if given, then the micro-batch ``batches.micro(step, 0, 0)`` (cast to
    ``dtype``, on the accelerator) forward through ``engine``, the mse loss, ``engine.backward``, ``engine.step``.
    Returns the losses."""
    losses = []
    for step in range(steps):
        if before_step is not None:
            before_step(step)
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def plain_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Any, steps: int) -> list[float]:
    """The same loop in plain PyTorch (fp32): ``zero_grad``, forward, mse, ``backward``, ``step``. Returns the
    losses."""
    losses = []
    for step in range(steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def mixed_precision_reference(job: Any, make_model: Callable[[], torch.nn.Module],
                              make_optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
                              ) -> TrainResult:
    """``make_model()``'s model trained in plain PyTorch on the job's batches as DeepSpeed's mixed-precision
    optimizers train it: the model cast to the job's dtype computes the loss and gradients, the optimizer
    (``make_optimizer(master)``, given the fp32 master module) steps an fp32 master made
    from that cast copy, and the master is copied back after each step (in fp32 all of it is the plain loop)."""
    dtype = dtype_of(job.dtype)
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    with original_functional_linear():  # a zero.Init in this process would have replaced F.linear
        master = make_model()
        work = copy.deepcopy(master).to(dtype)
        with torch.no_grad():  # DeepSpeed casts the model first and makes its fp32 master from that copy
            for param, cast in zip(master.parameters(), work.parameters()):
                param.copy_(cast.float())
        optimizer = make_optimizer(master)
        losses = []
        for step in range(job.steps):
            x, y = batches.micro(step, 0, 0)
            loss = mse(work(x.to(dtype)), y)
            grads = torch.autograd.grad(loss, list(work.parameters()))
            for param, grad in zip(master.parameters(), grads):
                param.grad = grad.float()
            optimizer.step()
            with torch.no_grad():
                for param, cast in zip(master.parameters(), work.parameters()):
                    cast.copy_(param)
            losses.append(loss.item())
        params = {name: p.detach().float().cpu().numpy().copy() for name, p in work.named_parameters()}
    return TrainResult(params, losses, [])
