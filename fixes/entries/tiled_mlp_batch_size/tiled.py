"""The user's model for tiled-mlp-batch-size: an MLP block whose forward runs through DeepSpeed's ALST tiled
compute, trained through a DeepSpeed engine, next to the same model in plain PyTorch.

ALST (Arctic Long Sequence Training, ``deepspeed.runtime.sequence_parallel.ulysses_sp``) saves memory on long
sequences by running an MLP over the sequence in shards: a user replaces the MLP's ``forward`` with one that calls
``TiledMLP.apply(mlp_forward, self, x, num_shards, compute_params)``, or the generic
``sequence_tiled_compute(...)`` (the module docstrings' example, which patches ``LlamaMLP.forward``; upstream's
test does the same on a two-MLP stack). Here :class:`TiledMLPBlock` is the Fixbook's ``TinyMLP`` (Linear, Tanh,
Linear; hidden size in = out) with its forward replaced that way, and :class:`MLPStack` stacks two of them, so the
second block's input gradient is what trains the first. Inputs are ``[batch, sequence, hidden]``.

``train(job, tiling, ...)`` trains the stack through ``deepspeed.initialize`` in this process (the engine's
``backward`` and ``step``); ``reference(job, ...)`` trains the same stack, untiled, in plain PyTorch: the fp32
master weights and bf16 working copy the way DeepSpeed's bf16 optimizers keep them (as
``fixes.harness.train_reference`` does for its own jobs). ``gradients(...)`` is the one-call check without an
engine: one forward and backward through the tiled function and through plain PyTorch.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
import torch

from ...harness.models import ModelSpec, SeededLinear, TinyMLP

# One MLP block: hidden 8 -> 16 -> 8 (TiledMLP needs the MLP's output shaped like its input).
BLOCK = ModelSpec(in_features=8, hidden=16, out_features=8, seed=0)
SEQ = 12  # tokens per sequence
SHARDS = 4  # tiles over the sequence: 12 tokens in 4 tiles of 3
BATCH = 2  # sequences per micro-batch: the bug needs 2 or more
TILINGS = ("TiledMLP", "sequence_tiled_compute")

_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"


def has_tiled_compute() -> bool:
    """Whether the installed DeepSpeed has ALST's tiled compute (``TiledMLP`` and ``sequence_tiled_compute``)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("deepspeed.runtime.sequence_parallel") is None:
        return False
    if importlib.util.find_spec(_MODULE) is None:
        return False
    module = importlib.import_module(_MODULE)
    return all(hasattr(module, name) for name in ("TiledMLP", "sequence_tiled_compute"))


class TiledMLPBlock(TinyMLP):
    """``TinyMLP`` whose forward runs over the sequence in ``shards`` tiles through ``tiling`` (one of
    :data:`TILINGS`), the way ALST patches a model's MLP; ``tiling=None``: the plain MLP."""

    def __init__(self, spec: ModelSpec = BLOCK, tiling: str | None = "TiledMLP", shards: int = SHARDS) -> None:
        super().__init__(spec)
        if tiling not in (None, *TILINGS):
            raise ValueError(f"tiling must be None or one of {TILINGS}, not {tiling!r}")
        self.tiling = tiling
        self.shards = shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tiling is None:
            return mlp_forward(self, x)
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, sequence_tiled_compute

        # the weights the tiles use: DeepSpeed ZeRO reduces their gradients after the last tile only
        compute_params = [self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias]
        if self.tiling == "TiledMLP":
            return TiledMLP.apply(mlp_forward, self, x, self.shards, compute_params)
        return sequence_tiled_compute(mlp_forward, x.shape[1], self.shards, {"x": x}, {"self": self}, "x",
                                      compute_params, output_unshard_dimension=1, output_reduction=None)


def mlp_forward(self: TinyMLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP's own forward, the function the tiles run (``fn`` of ``TiledMLP.apply``)."""
    return self.fc2(self.act(self.fc1(x)))


class MLPStack(torch.nn.Module):
    """An input projection (a stand-in for the layers before the MLPs: the tiled functions pass gradients only
    to an input that requires them) and two MLP blocks, one after the other: the second's input gradient trains
    the first, and the first's the projection."""

    def __init__(self, tiling: str | None = "TiledMLP", spec: ModelSpec = BLOCK, shards: int = SHARDS) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed + 2)
            self.embed = SeededLinear(spec.in_features, spec.in_features)
        self.mlp1 = TiledMLPBlock(spec, tiling, shards)
        self.mlp2 = TiledMLPBlock(ModelSpec(spec.in_features, spec.hidden, spec.out_features, spec.seed + 1),
                                  tiling, shards)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp2(self.mlp1(self.embed(x)))


def batches(steps: int, batch: int = BATCH, seq: int = SEQ, seed: int = 1,
            spec: ModelSpec = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ``[steps, batch, seq, hidden]``, seeded."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(steps, batch, seq, spec.in_features, generator=generator)
    targets = torch.randn(steps, batch, seq, spec.out_features, generator=generator)
    return inputs, targets


def loss_of(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target.float())**2).mean()


@dataclass(frozen=True)
class Run:
    """One training run: the loss of every step and the weights after the last."""

    losses: np.ndarray
    params: dict[str, np.ndarray]


def train(job: Any, tiling: str | None = "TiledMLP", batch: int = BATCH, seq: int = SEQ,
          shards: int = SHARDS) -> Run:
    """The user's training loop in this process (after :func:`fixes.harness.setup`): the stack with
    ``tiling``, ``deepspeed.initialize`` with the harness config of ``job`` (its ZeRO stage, dtype, optimizer;
    ``train_micro_batch_size_per_gpu`` = ``batch``), then ``job.steps`` steps of ``engine(x)``,
    ``engine.backward(loss)``, ``engine.step()``. ``job.fixes`` are applied first."""
    import deepspeed

    import fixes
    from ...harness.compare import dtype_of
    from ...harness.env import device
    from ...harness.training import ds_config, gathered_params, make_optimizer

    if job.fixes:
        fixes.apply(*job.fixes)
    dtype = dtype_of(job.dtype)
    model = MLPStack(tiling, shards=shards)
    config = ds_config(job.with_(micro_batch=batch), int(os.environ.get("WORLD_SIZE", "1")))
    with _quiet_info():
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                               config=config)
    inputs, targets = batches(job.steps, batch, seq, job.data_seed)
    losses = []
    for step in range(job.steps):
        loss = loss_of(engine(inputs[step].to(device(), dtype)), targets[step].to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return Run(np.array(losses), gathered_params(engine.module))


@contextlib.contextmanager
def _quiet_info() -> Iterator[None]:
    """DeepSpeed's logger at WARNING for a block: ``deepspeed.initialize`` logs its whole config and a groups
    summary at INFO, many lines per engine, and this module builds several engines in one process."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def reference(job: Any, batch: int = BATCH, seq: int = SEQ) -> Run:
    """The same training in plain PyTorch, the stack untiled: fp32 master weights, a working copy in the
    job's dtype that runs forward and backward, the optimizer on the master weights (for fp32 the two are the
    same values)."""
    from ...harness.compare import dtype_of
    from ...harness.env import device
    from ...harness.training import make_optimizer, original_functional_linear

    dtype = dtype_of(job.dtype)
    place = device()
    inputs, targets = batches(job.steps, batch, seq, job.data_seed)
    with original_functional_linear():
        master = MLPStack(None).to(place)
        work = copy.deepcopy(master).to(dtype)
        with torch.no_grad():  # DeepSpeed casts the model first and makes its fp32 master from that copy
            for param, work_param in zip(master.parameters(), work.parameters()):
                param.copy_(work_param.float())
        optimizer = make_optimizer(job, master.parameters())
        losses = []
        for step in range(job.steps):
            loss = loss_of(work(inputs[step].to(place, dtype)), targets[step].to(place))
            grads = torch.autograd.grad(loss, list(work.parameters()))
            for param, grad in zip(master.parameters(), grads):
                param.grad = grad.float()
            optimizer.step()
            with torch.no_grad():
                for param, work_param in zip(master.parameters(), work.parameters()):
                    work_param.copy_(param)
            losses.append(loss.item())
        params = {name: p.detach().float().cpu().numpy().copy() for name, p in work.named_parameters()}
    return Run(np.array(losses), params)


def _block_inputs(batch: int, seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded ``[batch, seq, hidden]`` input of :func:`gradients` and the incoming gradient of its output."""
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(batch, seq, BLOCK.in_features, generator=generator).to(dtype)
    incoming = torch.randn(batch, seq, BLOCK.out_features, generator=generator).to(dtype)
    return x, incoming


def gradients(tiling: str | None, dtype: str = "float32", batch: int = BATCH, seq: int = SEQ,
              shards: int = SHARDS) -> dict[str, np.ndarray]:
    """One forward and backward of a single block (no engine) on a seeded ``[batch, seq, hidden]`` input,
    through ``tiling`` (None: plain PyTorch), the output's gradient fixed: the output, the input's gradient and
    every weight's gradient."""
    from ...harness.compare import dtype_of
    from ...harness.training import original_functional_linear

    dtype_ = dtype_of(dtype)
    x, incoming = _block_inputs(batch, seq, dtype_)
    x.requires_grad_()
    with original_functional_linear():
        block = TiledMLPBlock(BLOCK, tiling, shards).to(dtype_)
        output = block(x)
        output.backward(incoming)
    found = {"output": output.detach(), "x.grad": x.grad}
    found.update({f"{name}.grad": p.grad for name, p in block.named_parameters()})
    return {name: t.float().cpu().numpy() for name, t in found.items()}


def tile_by_tile(tiling: str, dtype: str = "bfloat16", batch: int = BATCH, seq: int = SEQ,
                 shards: int = SHARDS) -> dict[str, np.ndarray]:
    """What :func:`gradients` must give for ``tiling``, in plain PyTorch, tile by tile: the output from the MLP run
    on each tile of sequence positions alone (both forwards tile the sequence); the gradients from the MLP run on
    each tile of the fixed backward (``TiledMLP`` tiles the ``batch * seq`` token rows, ``sequence_tiled_compute``
    the sequence positions of every sequence) back-propagated with its own tokens' incoming gradient, each weight's
    gradient summed over the tiles in tile order, in the weights' dtype, as a tiled backward accumulates ``.grad``.
    In bf16 that sum rounds after every tile, where one matmul over all tokens rounds once (beyond the
    one-operation tolerance of ``harness.TOLERANCES``, on every release, at batch 1 too); in float32 it equals the
    untiled gradients within the tolerance."""
    from ...harness.compare import dtype_of
    from ...harness.training import original_functional_linear

    if tiling not in TILINGS:
        raise ValueError(f"tiling must be one of {TILINGS}, not {tiling!r}")
    dtype_ = dtype_of(dtype)
    x, incoming = _block_inputs(batch, seq, dtype_)
    hidden = x.shape[-1]
    if tiling == "TiledMLP":
        tiles = list(zip(x.reshape(-1, hidden).chunk(shards, 0), incoming.reshape(-1, hidden).chunk(shards, 0)))
    else:
        tiles = list(zip(x.chunk(shards, 1), incoming.chunk(shards, 1)))
    with original_functional_linear():
        block = TiledMLPBlock(BLOCK, None, shards).to(dtype_)
        names, params = zip(*block.named_parameters())
        with torch.no_grad():
            outputs = [mlp_forward(block, x_tile) for x_tile in x.chunk(shards, 1)]
        x_grads, sums = [], None
        for x_tile, incoming_tile in tiles:
            x_tile = x_tile.detach().requires_grad_()
            output = mlp_forward(block, x_tile)
            x_grad, *param_grads = torch.autograd.grad(output, [x_tile, *params], incoming_tile)
            x_grads.append(x_grad)
            sums = param_grads if sums is None else [total + grad for total, grad in zip(sums, param_grads)]
    dim = 0 if tiling == "TiledMLP" else 1
    found = {"output": torch.cat(outputs, 1), "x.grad": torch.cat(x_grads, dim).reshape(x.shape)}
    found.update({f"{name}.grad": total for name, total in zip(names, sums)})
    return {name: t.float().cpu().numpy() for name, t in found.items()}


__all__ = ["BATCH", "BLOCK", "MLPStack", "Run", "SEQ", "SHARDS", "TILINGS", "TiledMLPBlock", "batches",
           "gradients", "has_tiled_compute", "tile_by_tile", "loss_of", "mlp_forward", "reference", "train"]
