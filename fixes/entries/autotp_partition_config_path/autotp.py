"""AutoTP training with a custom ``partition_config`` on two ranks: what each rank holds, and what it trains.

The model is a transformer's skeleton: ``layers[i].mlp.up_proj`` / ``layers[i].mlp.down_proj`` (a Llama MLP, no
attention), four levels deep as in every Hugging Face decoder (``model.layers.0.mlp.up_proj``). The user's config
names the layers by their path, as DeepSpeed's own presets do: ``.*\\.mlp\\.up_proj\\.weight$`` column-parallel,
``.*\\.mlp\\.down_proj\\.weight$`` row-parallel. With ``autotp_size`` 2 (two ranks, one tensor-parallel group)
each rank must then hold half of every weight, and the pair must train exactly like the unsharded model in plain
PyTorch: the column shard's outputs feed the row shard, whose partial sums are all-reduced.

Both ranks of a tensor-parallel group see the same batch (DeepSpeed checks it on the first forward).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...harness.models import ModelSpec, make_batches, mse
from ...harness.compare import dtype_of
from ...harness.training import Job, ds_config, make_optimizer

HIDDEN, INTERMEDIATE, LAYERS = 8, 16, 2
WORLD_SIZE = 2  # ranks; autotp_size 2: one tensor-parallel group of both
TP = 2
# The data: make_batches of a spec with the model's input and output width (its hidden size is unused).
DATA = ModelSpec(in_features=HIDDEN, hidden=INTERMEDIATE, out_features=HIDDEN)

# The user's custom patterns: each names the layer by the module it sits in, as the built-in presets do.
PARTITION_CONFIG: dict[str, Any] = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.mlp\.up_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    ],
}
# The same layers named without the enclosing module: these match the name an affected release builds as well.
LOOSE_PARTITION_CONFIG: dict[str, Any] = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*up_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*down_proj\.weight$"], "partition_type": "row"},
    ],
}


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE, bias=False)
        self.act = torch.nn.Tanh()
        self.down_proj = torch.nn.Linear(INTERMEDIATE, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class TinyDecoder(torch.nn.Module):
    """``layers.{i}.mlp.{up,down}_proj``, seeded locally (the same weights wherever it is built)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = torch.nn.ModuleList(DecoderLayer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def autotp_job(partition_config: dict[str, Any] | None = None, preset_model: str | None = None,
               autotp_size: int = TP, **changes: Any) -> Job:
    """The harness job: ZeRO-0, fp32, SGD, with ``tensor_parallel`` set (custom patterns by default). Its ``model``
    is :data:`DATA`, the widths the batches are drawn with (the ranks build :class:`TinyDecoder`)."""
    tensor_parallel: dict[str, Any] = {"autotp_size": autotp_size}
    if preset_model is not None:
        tensor_parallel["preset_model"] = preset_model
    else:
        tensor_parallel["partition_config"] = PARTITION_CONFIG if partition_config is None else partition_config
    return Job(zero_stage=0, steps=2, model=DATA, config={"tensor_parallel": tensor_parallel}).with_(**changes)


def train_in_rank(job: Job) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): what a user's script does. ``deepspeed.initialize`` with the
    config (AutoTP shards the model while it builds the engine), then ``job.steps`` steps on the same batches as
    the other rank. Returns the shape and module type of every layer this rank holds, its weights and losses."""
    import deepspeed

    import fixes
    from ...harness.env import device

    if job.fixes:
        fixes.apply(*job.fixes)
    model = TinyDecoder()
    optimizer = make_optimizer(job, model.parameters())
    config = ds_config(job, int(os.environ.get("WORLD_SIZE", "1")))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    held = {name: tuple(param.shape) for name, param in engine.module.named_parameters()}
    types = {name: type(module).__name__ for name, module in engine.module.named_modules() if name.endswith("_proj")}
    batches = make_batches(DATA, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    weights = {name: param.detach().float().cpu().numpy().copy() for name, param in engine.module.named_parameters()}
    _leave_together()
    return {"held": held, "types": types, "losses": np.array(losses), "weights": weights}


def build_in_rank(job: Job) -> dict[str, Any]:
    """One rank: ``deepspeed.initialize`` only; the shape of every parameter this rank holds."""
    import deepspeed

    import fixes

    if job.fixes:
        fixes.apply(*job.fixes)
    model = TinyDecoder()
    config = ds_config(job, int(os.environ.get("WORLD_SIZE", "1")))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                           config=config)
    held = {name: tuple(param.shape) for name, param in engine.module.named_parameters()}
    _leave_together()
    return {"held": held}


def _leave_together() -> None:
    """Wait for every rank before returning. A launched rank ends when its function returns, and rank 0 hosts the
    ranks' TCPStore: AutoTP's process groups are made while ``deepspeed.initialize`` runs, and where nothing after
    that goes through both ranks (a tensor-parallel group of one data-parallel rank, no layer sharded), rank 0 can
    finish and leave while rank 1 still waits on the store to connect a group ("DistNetworkError: Connection reset
    by peer" on rank 1, about one launch in seven on a busy 2-core machine)."""
    torch.distributed.barrier()


def full_shapes() -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in TinyDecoder().named_parameters()}


def configured_shapes(partition_config: dict[str, Any] = PARTITION_CONFIG, tp: int = TP) -> dict[str, tuple[int, ...]]:
    """What each rank must hold by the config, read in plain Python: the first spec whose pattern ``re.match``-es
    the parameter's full name (``layers.0.mlp.up_proj.weight``); a column-parallel weight keeps 1/tp of its rows,
    a row-parallel one 1/tp of its columns, anything unmatched stays whole."""
    shapes = {}
    for name, shape in full_shapes().items():
        kind = next((spec["partition_type"] for spec in partition_config["layer_specs"]
                     if any(re.match(pattern, name) for pattern in spec["patterns"])), None)
        dim = {"column": 0, "row": 1}.get(kind)
        shapes[name] = shape if dim is None else tuple(n // tp if d == dim else n for d, n in enumerate(shape))
    return shapes


def _assemble(shards: list[np.ndarray], full: tuple[int, ...]) -> np.ndarray:
    """The whole weight from the ranks' pieces: a piece that is already whole is taken from rank 0; otherwise the
    pieces are joined along the dimension they split (DeepSpeed splits contiguously, rank 0 first)."""
    if shards[0].shape == full:
        return shards[0]
    [dim] = [d for d, n in enumerate(full) if shards[0].shape[d] != n]
    return np.concatenate(shards, axis=dim)


@dataclass
class Run:
    """One job on two ranks and in plain PyTorch."""

    held: list[dict[str, tuple[int, ...]]]  # per rank: parameter -> shape it holds
    types: list[dict[str, str]]  # per rank: layer -> module type after deepspeed.initialize
    configured: dict[str, tuple[int, ...]]  # parameter -> shape each rank must hold by the config
    losses: np.ndarray  # [rank, step]
    reference_losses: np.ndarray  # [step]
    weights: dict[str, np.ndarray]  # after training, assembled from the ranks' shards
    reference_weights: dict[str, np.ndarray]
    full: dict[str, tuple[int, ...]] = field(default_factory=full_shapes)

    @property
    def unsharded(self) -> list[str]:
        """The parameters the config shards that a rank holds whole."""
        return sorted({name for held in self.held for name, shape in held.items()
                       if self.configured[name] != self.full[name] and shape == self.full[name]})

    @property
    def sharded_as_configured(self) -> bool:
        return all(held == self.configured for held in self.held)

    def elements_per_rank(self) -> np.ndarray:
        """How many parameter elements each rank holds."""
        return np.array([sum(int(np.prod(shape)) for shape in held.values()) for held in self.held], dtype=np.float64)

    def configured_elements(self) -> np.ndarray:
        per_rank = sum(int(np.prod(shape)) for shape in self.configured.values())
        return np.full(len(self.held), per_rank, dtype=np.float64)

    def table(self) -> list[dict[str, Any]]:
        """One row per parameter: its full shape, the shape the config gives each rank, what each rank holds."""
        return [{"parameter": name, "full": self.full[name], "configured per rank": self.configured[name],
                 **{f"rank {rank} holds": held[name] for rank, held in enumerate(self.held)},
                 **{f"rank {rank} layer": types.get(name.rsplit(".", 1)[0], "") for rank, types in enumerate(self.types)}}
                for name in self.full]

    def __str__(self) -> str:
        state = "sharded as configured" if self.sharded_as_configured else f"not sharded: {', '.join(self.unsharded)}"
        return (f"each rank: {state}; parameter elements per rank {self.elements_per_rank().astype(int).tolist()} "
                f"(configured {self.configured_elements().astype(int).tolist()}); losses per rank "
                f"{np.round(self.losses, 6).tolist()}, plain PyTorch {np.round(self.reference_losses, 6).tolist()}")


def run(job: Job, partition_config: dict[str, Any] | None = None, world_size: int = WORLD_SIZE,
        timeout: float = 180.0) -> Run:
    """``job`` on ``world_size`` ranks (:func:`train_in_rank`) and in plain PyTorch (:func:`fixes.harness.train_reference`
    of :class:`TinyDecoder` on the same batches).
    ``partition_config``: the patterns the configured shapes are read from (default: the job's own, or the llama
    preset's MLP patterns, which are the same as :data:`PARTITION_CONFIG`)."""
    from ...harness import launch, train_reference

    results = launch(train_in_rank, world_size, job, timeout=timeout)
    reference = train_reference(job, build_model=lambda _data: TinyDecoder())  # the unsharded model, same batches
    full = full_shapes()
    tensor_parallel = job.config["tensor_parallel"]
    patterns = partition_config or tensor_parallel.get("partition_config") or PARTITION_CONFIG
    configured = configured_shapes(patterns, tensor_parallel["autotp_size"])
    weights = {name: _assemble([r["weights"][name] for r in results], full[name]) for name in full}
    return Run([{name: tuple(shape) for name, shape in r["held"].items()} for r in results],
               [dict(r["types"]) for r in results], configured, np.stack([r["losses"] for r in results]),
               np.array(reference.losses), weights, reference.params, full)
