"""AutoTP training of a model that carries a Hugging Face ``tp_plan``, on two ranks: save, convert to a universal
checkpoint, resume.

The model is a Hugging Face decoder's skeleton as transformers builds it: ``layers[i].mlp.up_proj`` /
``layers[i].mlp.down_proj`` (a Llama MLP, with biases, no attention), and a ``config`` whose
``base_model_tp_plan`` is the one transformers' Llama config declares for these layers
(``"layers.*.mlp.up_proj": "colwise"``, ``"layers.*.mlp.down_proj": "rowwise"``). DeepSpeed reads the plan from
``model.config.base_model_tp_plan`` (or ``model._tp_plan``: ``deepspeed.runtime.tensor_parallel.config.
_get_hf_tp_plan``), so a plain ``torch.nn.Module`` with such a ``config`` is what AutoTP sees of a transformers
model; nothing is downloaded and transformers is not needed.

The user's job: ``tensor_parallel.autotp_size`` 2 on two ranks (one tensor-parallel group), ZeRO-1 (the universal
conversion reads the ZeRO optimizer's files), torch's Adam, :data:`SAVED_AFTER` steps, ``save_checkpoint``, rank 0
runs ``python -m deepspeed.checkpoint.ds_to_universal`` on it (its ``main`` in this process, so a fix applied here
takes part), a fresh engine with ``"checkpoint": {"load_universal": true}`` loads it and trains to :data:`STEPS`.
Plain PyTorch trains the unsharded model the same steps, uninterrupted. Both ranks of a tensor-parallel group see
the same batch (DeepSpeed checks it on the first forward).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ...harness.compare import dtype_of
from ...harness.models import ModelSpec, make_batches, mse
from ...harness.training import Job, ds_config

HIDDEN, INTERMEDIATE, LAYERS = 8, 16, 2
WORLD_SIZE = 2  # ranks; autotp_size 2: one tensor-parallel group of both
TP = 2
STEPS = 4  # optimizer steps in all
SAVED_AFTER = 2  # the checkpoint is saved after this many; the resumed engine runs the rest
# The data: make_batches of a spec with the model's input and output width (its hidden size is unused).
DATA = ModelSpec(in_features=HIDDEN, hidden=INTERMEDIATE, out_features=HIDDEN)

# transformers' LlamaConfig.base_model_tp_plan, the MLP's two entries
TP_PLAN: dict[str, str] = {"layers.*.mlp.up_proj": "colwise", "layers.*.mlp.down_proj": "rowwise"}
# The same layers by a custom partition_config instead of the tp_plan (DeepSpeed's other route, which keeps the info)
PARTITION_CONFIG: dict[str, Any] = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.mlp\.up_proj\.weight$"], "partition_type": "column"},
        {"patterns": [r".*\.mlp\.down_proj\.weight$"], "partition_type": "row"},
    ],
}
# The universal checkpoint info a tp_plan model must carry for these layers (what collect_autotp_universal_
# checkpoint_info finds on the sharded model): the row-parallel weights, and the row-parallel biases, which every
# rank holds whole.
ROW_PARALLEL = [rf"^layers\.{i}\.mlp\.down_proj\.weight$" for i in range(LAYERS)]
REPLICATED = [rf"^layers\.{i}\.mlp\.down_proj\.bias$" for i in range(LAYERS)]
MISSING = "Required universal_checkpoint_info state is missing in checkpoint"  # ds_to_universal's assertion


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(HIDDEN, INTERMEDIATE)
        self.act = torch.nn.Tanh()
        self.down_proj = torch.nn.Linear(INTERMEDIATE, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class DecoderLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class TinyHFDecoder(torch.nn.Module):
    """``layers.{i}.mlp.{up,down}_proj`` and a ``config`` with transformers' ``base_model_tp_plan`` for them
    (``tp_plan=None``: a config without a plan), seeded locally (the same weights wherever it is built)."""

    def __init__(self, tp_plan: dict[str, str] | None = TP_PLAN, seed: int = 0) -> None:
        super().__init__()
        self.config = SimpleNamespace(base_model_tp_plan=None if tp_plan is None else dict(tp_plan))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.layers = torch.nn.ModuleList(DecoderLayer() for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def autotp_job(zero_stage: int = 1, autotp_size: int = TP, partition_config: dict[str, Any] | None = None,
               load_universal: bool = False, **changes: Any) -> Job:
    """The harness job: ZeRO-1, fp32, torch's Adam, :data:`STEPS` steps, ``tensor_parallel.autotp_size`` set
    (``partition_config``: DeepSpeed's custom patterns, which take precedence over the model's tp_plan).
    ``load_universal``: the ``checkpoint`` section that makes ``load_checkpoint`` read a universal checkpoint."""
    tensor_parallel: dict[str, Any] = {"autotp_size": autotp_size}
    if partition_config is not None:
        tensor_parallel["partition_config"] = partition_config
    config: dict[str, Any] = {"tensor_parallel": tensor_parallel}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return Job(zero_stage=zero_stage, optimizer="adam", lr=0.01, steps=STEPS, model=DATA,
               config=config).with_(**changes)


def _build(job: Job, tp_plan: dict[str, str] | None) -> Any:
    import deepspeed

    from ...harness.training import make_optimizer

    model = TinyHFDecoder(tp_plan)
    config = ds_config(job, int(os.environ.get("WORLD_SIZE", "1")))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                           config=config)
    return engine


def _train(engine: Any, job: Job, steps: range) -> list[float]:
    from ...harness.env import device

    batches = make_batches(DATA, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses = []
    for step in steps:
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def universal_info(engine: Any) -> dict[str, Any] | None:
    """What ``save_checkpoint`` writes as the checkpoint's ``universal_checkpoint_info``: the attribute
    ``deepspeed.initialize`` set on the model (None where it set none)."""
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None)
    return None if info is None else {key: (list(value) if isinstance(value, (list, tuple)) else value)
                                      for key, value in info.items()}


def to_universal(checkpoint_dir: str, inject_missing_state: bool = False) -> str:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder <dir>/<latest tag>`` in this process
    (:func:`fixes.harness.universal.convert`)."""
    from ...harness.universal import convert

    return convert(checkpoint_dir, inject_missing_state=inject_missing_state)


def error_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def is_the_bug(error: BaseException) -> bool:
    """Whether ``error`` is ds_to_universal's refusal of a checkpoint without ``universal_checkpoint_info``
    (``_check_for_required_state``'s assertion)."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return isinstance(error, AssertionError) and MISSING in str(error) and "_check_for_required_state" in names


def _leave_together() -> None:
    """Every rank waits for the others before returning (rank 0 hosts the ranks' store)."""
    torch.distributed.barrier()


def info_in_rank(job: Job, tp_plan: dict[str, str] | None = TP_PLAN) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): ``deepspeed.initialize`` only. Returns the universal checkpoint
    info set on the model, the shape each parameter has on this rank and the type of each ``*_proj`` layer."""
    import fixes

    if job.fixes:
        fixes.apply(*job.fixes)
    engine = _build(job, tp_plan)
    held = {name: tuple(param.shape) for name, param in engine.module.named_parameters()}
    types = {name: type(module).__name__ for name, module in engine.module.named_modules() if name.endswith("_proj")}
    info = universal_info(engine)
    _leave_together()
    return {"info": info, "held": held, "types": types}


def user_script_in_rank(job: Job, directory: str, tp_plan: dict[str, str] | None = TP_PLAN,
                        inject_missing_state: bool = False) -> dict[str, Any]:
    """One rank of the user's job (for :func:`fixes.harness.launch`): :data:`SAVED_AFTER` steps,
    ``save_checkpoint(directory)``, rank 0 converts it (:func:`to_universal`), a fresh engine with
    ``load_universal`` loads it and trains the remaining steps. Returns the universal checkpoint info on the model,
    the conversion's error line ("" if none) and whether it is this bug's, the losses and (where it resumed) this
    rank's weights, gathered to full size by the caller."""
    import torch.distributed as dist

    import fixes

    if job.fixes:
        fixes.apply(*job.fixes)
    rank = int(os.environ.get("RANK", "0"))
    engine = _build(job, tp_plan)
    info = universal_info(engine)
    losses = _train(engine, job, range(SAVED_AFTER))
    engine.save_checkpoint(directory)
    del engine
    dist.barrier()
    error, bug = "", False
    if rank == 0:
        try:
            to_universal(directory, inject_missing_state)
        except Exception as caught:  # noqa: BLE001 - recorded: the bug's assertion, or another failure
            error, bug = error_line(caught), is_the_bug(caught)
    verdict = [error, bug]
    dist.broadcast_object_list(verdict, src=0)
    error, bug = verdict
    out: dict[str, Any] = {"info": info, "error": error, "bug": bug, "losses": np.array(losses), "weights": None}
    if error:
        _leave_together()
        return out
    engine = _build(job.with_(config={**job.config, "checkpoint": {"load_universal": True}}), tp_plan)
    if engine.load_checkpoint(directory)[0] is None:
        raise RuntimeError(f"load_checkpoint found no universal checkpoint in {directory}")
    out["losses"] = np.array(losses + _train(engine, job, range(SAVED_AFTER, job.steps)))
    out["weights"] = {name: param.detach().float().cpu().numpy().copy()
                      for name, param in engine.module.named_parameters()}
    _leave_together()
    return out


def full_shapes() -> dict[str, tuple[int, ...]]:
    return {name: tuple(param.shape) for name, param in TinyHFDecoder().named_parameters()}


def _assemble(shards: list[np.ndarray], full: tuple[int, ...]) -> np.ndarray:
    """The whole parameter from the ranks' pieces: a piece that is already whole is taken from rank 0; otherwise the
    pieces are joined along the dimension they split (DeepSpeed splits contiguously, rank 0 first)."""
    if shards[0].shape == full:
        return shards[0]
    [dim] = [d for d, n in enumerate(full) if shards[0].shape[d] != n]
    return np.concatenate(shards, axis=dim)


@dataclass
class Run:
    """The user's job on two ranks, and plain PyTorch."""

    info: dict[str, Any] | None  # the universal checkpoint info on rank 0's model after deepspeed.initialize
    error: str  # the conversion's error line, "" if it converted
    bug: bool  # whether that error is ds_to_universal's refusal of a checkpoint without the info
    losses: np.ndarray  # [rank, step]
    reference_losses: np.ndarray  # [step]
    weights: dict[str, np.ndarray] | None  # after the resumed training, assembled from the ranks' shards
    reference_weights: dict[str, np.ndarray]

    def __str__(self) -> str:
        if self.error:
            return f"ds_to_universal: {self.error}"
        return (f"converted and resumed; losses per rank {np.round(self.losses, 6).tolist()}, plain PyTorch "
                f"{np.round(self.reference_losses, 6).tolist()}")


def reference(job: Job) -> Any:
    """Plain PyTorch: the unsharded model, the same batches, all :data:`STEPS` steps (torch's Adam)."""
    from ...harness import train_reference

    return train_reference(job, build_model=lambda _data: TinyHFDecoder())


def run(job: Job, tp_plan: dict[str, str] | None = TP_PLAN, inject_missing_state: bool = False,
        timeout: float = 240.0, world_size: int = WORLD_SIZE) -> Run:
    """:func:`user_script_in_rank` on ``world_size`` ranks (default :data:`WORLD_SIZE`) and :func:`reference`."""
    from ...harness import launch

    with tempfile.TemporaryDirectory(prefix="fixbook-autotp-tp-plan-") as directory:
        results = launch(user_script_in_rank, world_size, job, directory, tp_plan, inject_missing_state,
                         timeout=timeout)
    ref = reference(job)
    full = full_shapes()
    weights = None
    if results[0]["weights"] is not None:
        weights = {name: _assemble([r["weights"][name] for r in results], full[name]) for name in full}
    return Run(results[0]["info"], results[0]["error"], results[0]["bug"], np.stack([r["losses"] for r in results]),
               np.array(ref.losses), weights, ref.params)
