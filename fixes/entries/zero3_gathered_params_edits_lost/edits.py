"""ZeRO-3 on two ranks: edit the weights of a model built inside ``deepspeed.zero.Init`` within
``deepspeed.zero.GatheredParameters`` *without* ``modifier_rank``, then ``deepspeed.initialize`` and train, and compare
with plain PyTorch trained from the edited weights.

The edit loads other weights (:data:`LOADED`, what a pretrained model or another run holds) into the model built from
:data:`INITIAL`, every rank from the same state dict, in one of two ways a user writes (:data:`EDITS`):

- ``"load_state_dict"``: ``model.load_state_dict(state_dict)`` inside the block (``param.copy_`` under no_grad);
- ``"data_copy"``: ``param.data.copy_(state_dict[name])`` for each parameter (an edit through ``.data``).

Where the edit is lost the engine trains from :data:`INITIAL`; where the ``with`` raises, the user's script stops
there (the rank records the error and trains nothing).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...harness.models import ModelSpec, TinyMLP, make_batches, mse
from ...harness.training import Job

INITIAL = ModelSpec(seed=0)  # the weights zero.Init builds
LOADED = ModelSpec(seed=1)  # the weights loaded into them; plain PyTorch starts from these
# what upstream's check (and the fix) raises: the start of its message
DETECTED = "in-place modification of ZeRO-3 parameters inside GatheredParameters"


def edit_job(**changes: Any) -> Job:
    """ZeRO-3, the model built inside ``zero.Init``, every parameter partitioned, SGD, three steps. ``job.model`` is
    the model that is *loaded* (the reference starts from it); the engine's own model is :data:`INITIAL`."""
    return Job(zero_stage=3, zero3_init=True, steps=3, model=LOADED, config={"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


# ---- the user's code ----------------------------------------------------------------------------------------------

def load_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], modifier_rank: int | None = None) -> None:
    """Load a state dict into a ZeRO-3 model: gather every parameter, load, exit. Every rank has the same file, so
    ``modifier_rank`` looks unnecessary and is left out (``None``, the default)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=modifier_rank):
        model.load_state_dict(state_dict)


def data_copy(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], modifier_rank: int | None = None) -> None:
    """The same load written through ``.data``, as older scripts and weight-init code write it."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=modifier_rank):
        for name, param in model.named_parameters():
            param.data.copy_(state_dict[name])


EDITS: dict[str, Callable[..., None]] = {"load_state_dict": load_state_dict, "data_copy": data_copy}


# ---- one rank -----------------------------------------------------------------------------------------------------

def _build(job: Job) -> tuple[torch.nn.Module, dict[str, Any]]:
    """:data:`INITIAL` built inside ``zero.Init`` (or plainly where ``job.zero3_init`` is False), ``job.fixes``
    applied first."""
    import deepspeed

    import fixes
    from ...harness.compare import dtype_of
    from ...harness.training import ds_config

    if job.fixes:
        fixes.apply(*job.fixes)
    if dtype_of(job.dtype) == torch.float16:
        from ...harness.precision import allow_fp16_on_cpu

        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    config = ds_config(job, int(os.environ.get("WORLD_SIZE", "1")))
    if not job.zero3_init:
        return TinyMLP(INITIAL), config
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TinyMLP(INITIAL)
    return model, config


def _holds(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> bool:
    """Whether the model's full weights (gathered one parameter at a time, read only) equal ``state_dict``'s, in the
    model's dtype."""
    from ...harness.training import gathered_params

    now = gathered_params(model)
    return all(np.array_equal(now[name], value.to(next(model.parameters()).dtype).float().numpy())
               for name, value in state_dict.items())


def edit_and_train(job: Job, edits: tuple[str, ...], modifier_rank: int | None = None) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): build :data:`INITIAL` inside ``zero.Init``, load ``job.model``'s
    weights with each edit of ``edits`` in turn (``modifier_rank`` passed on), then ``deepspeed.initialize`` and train
    ``job.steps`` steps on this rank's shard of every batch. Returns, per edit, the error the ``with`` raised ("" if
    none) and whether the model held the loaded weights right after it; if no edit raised, the losses and the full
    weights after training."""
    import deepspeed

    from ...harness.env import device
    from ...harness.training import gathered_params, make_optimizer

    model, config = _build(job)
    state_dict = TinyMLP(job.model).state_dict()
    errors, held = [], []
    for edit in edits:
        try:
            EDITS[edit](model, state_dict, modifier_rank)
            errors.append("")
        except RuntimeError as exc:
            if DETECTED not in str(exc):
                raise
            errors.append(str(exc))
        held.append(_holds(model, state_dict))
    result: dict[str, Any] = {"errors": errors, "held": held}
    if any(errors):
        return result  # the user's script stops at the error
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                           config=config)
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, rank)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    result.update(losses=np.array(losses), params=gathered_params(engine.module))
    return result


# ---- both ranks, next to plain PyTorch ----------------------------------------------------------------------------

@dataclass(frozen=True)
class EditRun:
    """Both ranks of one run. ``errors[rank][i]`` / ``held[rank][i]``: the error of edit ``edits[i]`` on that rank
    ("" if none), whether the model held the loaded weights after it. The training fields are None where an edit
    raised (nothing was trained)."""

    edits: tuple[str, ...]
    modifier_rank: int | None
    errors: tuple[tuple[str, ...], ...]
    held: tuple[tuple[bool, ...], ...]
    losses: np.ndarray | None  # [rank, step]
    reference_losses: np.ndarray  # [rank, step], plain PyTorch from the loaded weights
    params: dict[str, np.ndarray] | None  # rank 0's full weights after training
    reference_params: dict[str, np.ndarray]

    @property
    def raised(self) -> bool:
        """Every rank raised upstream's error on every edit."""
        return all(all(errors) for errors in self.errors)

    @property
    def silently_lost(self) -> list[str]:
        """The edits that raised on no rank and left the model without the loaded weights on some rank."""
        return [edit for i, edit in enumerate(self.edits)
                if not any(errors[i] for errors in self.errors) and not all(held[i] for held in self.held)]

    def __str__(self) -> str:
        lines = []
        for i, edit in enumerate(self.edits):
            raised = [bool(errors[i]) for errors in self.errors]
            held = [bool(h[i]) for h in self.held]
            lines.append(f"{edit} (modifier_rank={self.modifier_rank}): raised per rank {raised}; "
                         f"model holds the loaded weights afterwards, per rank {held}")
        if self.losses is not None:
            lines.append(f"first loss per rank {np.round(self.losses[:, 0], 6).tolist()} vs PyTorch from the loaded "
                         f"weights {np.round(self.reference_losses[:, 0], 6).tolist()}")
        return "\n".join(lines)


def run(job: Job, edits: tuple[str, ...] = tuple(EDITS), modifier_rank: int | None = None, world_size: int = 2,
        timeout: float = 240) -> EditRun:
    """:func:`edit_and_train` on ``world_size`` fresh ranks, and plain PyTorch data parallelism trained from
    ``job.model`` on the same shards."""
    from ...harness.launch import launch
    from ...harness.training import train_reference

    unknown = [edit for edit in edits if edit not in EDITS]
    if unknown:
        raise ValueError(f"unknown edit(s) {unknown}; use {', '.join(EDITS)}")
    results = launch(edit_and_train, world_size, job, tuple(edits), modifier_rank, timeout=timeout)
    reference = train_reference(job, world_size)
    trained = "losses" in results[0]
    if any(("losses" in r) != trained for r in results):
        raise AssertionError(f"the ranks disagree on whether an edit raised: {[r['errors'] for r in results]}")
    return EditRun(tuple(edits), modifier_rank, tuple(tuple(r["errors"]) for r in results),
                   tuple(tuple(bool(h) for h in r["held"]) for r in results),
                   np.stack([r["losses"] for r in results]) if trained else None,
                   np.array(reference.losses).reshape(job.steps, world_size).T,
                   results[0]["params"] if trained else None, reference.params)


# ---- blocks that must not raise, and edits on one rank ------------------------------------------------------------

def reads_and_one_rank_edits(fixes_to_apply: tuple[str, ...] = ()) -> dict[str, str]:
    """One rank (for :func:`fixes.harness.launch`), ``fixes_to_apply`` applied: ``GatheredParameters`` blocks without
    ``modifier_rank`` that only read (one of them runs the engine's forward, whose ZeRO-3 hooks fetch and release
    parameters inside the block; one after an optimizer step), and two that only rank 0 edits: through ``.data``
    within its own share, and in place under ``no_grad``. Returns per block "raised" (upstream's error) or ""."""
    import deepspeed

    import fixes
    from ...harness.training import ds_config, make_optimizer

    if fixes_to_apply:
        fixes.apply(*fixes_to_apply)
    job = edit_job()
    config = ds_config(job, int(os.environ.get("WORLD_SIZE", "1")))
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = TinyMLP(INITIAL)
    rank0 = os.environ.get("RANK", "0") == "0"
    params = list(model.parameters())

    def block(body: Callable[[], Any]) -> str:
        try:
            with deepspeed.zero.GatheredParameters(params):
                body()
        except RuntimeError as exc:
            if DETECTED not in str(exc):
                raise
            return "raised"
        return ""

    def scale_own_share() -> None:
        if rank0:
            params[0].data.view(-1)[0] *= 2  # the first element: in rank 0's share

    def scale_no_grad() -> None:
        if rank0:
            with torch.no_grad():
                params[-1].mul_(2)

    out = {"read": block(lambda: [p.sum().item() for p in params]),
           "rank 0 scales its own share through .data": block(scale_own_share),
           "rank 0 alone scales a parameter under no_grad": block(scale_no_grad)}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(job, model.parameters()),
                                           config=config)
    from ...harness.env import device

    x = torch.randn(job.micro_batch, INITIAL.in_features, device=device())
    out["forward inside, after initialize"] = block(lambda: engine(x))
    engine.backward(mse(engine(x), torch.zeros(job.micro_batch, INITIAL.out_features, device=device())))
    engine.step()
    out["read after a step"] = block(lambda: [p.sum().item() for p in params])
    return out


__all__ = ["DETECTED", "EDITS", "EditRun", "INITIAL", "LOADED", "data_copy", "edit_and_train", "edit_job",
           "load_state_dict", "reads_and_one_rank_edits", "run"]
