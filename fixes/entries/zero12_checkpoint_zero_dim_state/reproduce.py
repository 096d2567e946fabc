"""How zero12-checkpoint-zero-dim-state is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe.

Also what the notebook shares with it: :func:`elastic_job` (the user's job: ZeRO-1/2 with ``elastic_checkpoint``,
torch Adam), :func:`is_this_error`, :func:`save` (train, ``engine.save_checkpoint``, read back what the ZeRO
optimizer file holds) and :func:`checkpoint_state` (that file's contents as the harness compares optimizer states).
"""
from __future__ import annotations

import glob
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from ...exceptions import CannotTellError

SAVED_AFTER = 2  # optimizer steps before save_checkpoint
ERROR = "slice() cannot be applied to a 0-dim tensor"
ADAM_STATE = ("exp_avg", "exp_avg_sq", "step")


def elastic_job(stage: int = 1, **changes: Any) -> Any:
    """ZeRO ``stage`` with ``"elastic_checkpoint": true``, a client ``torch.optim.Adam`` (lr 0.01), fp32."""
    from ...harness import Job

    return Job(zero_stage=stage, optimizer="adam", lr=0.01, steps=SAVED_AFTER,
               config={"zero_optimization": {"stage": stage, "elastic_checkpoint": True}}).with_(**changes)


def is_this_error(error: BaseException) -> bool:
    """The bug's error: ``IndexError: slice() cannot be applied to a 0-dim tensor.``"""
    return isinstance(error, IndexError) and ERROR in str(error)


def zero_file(checkpoint_dir: str) -> str:
    """The one ZeRO optimizer file ``save_checkpoint`` wrote under ``checkpoint_dir`` (one rank)."""
    found = glob.glob(os.path.join(checkpoint_dir, "*", "*zero_pp_rank_0_*optim_states.pt"))
    if len(found) != 1:
        raise CannotTellError(f"expected one ZeRO optimizer file in {checkpoint_dir}, found {found}")
    return found[0]


def checkpoint_state(checkpoint_dir: str) -> dict[str, Any]:
    """What the ZeRO optimizer file of a one-rank ZeRO-1/2 checkpoint holds, flattened as
    :func:`fixes.harness.resume.optimizer_state` flattens an optimizer: ``weights`` (the fp32 master partition,
    ``single_partition_of_fp32_groups``, the padding already cut), ``exp_avg``, ``exp_avg_sq`` (the base optimizer
    state, ``base_optimizer_state``) concatenated over the parameter groups, ``step`` (the largest step count),
    and ``layout``: ``"elastic"`` (a list of per-group states) or ``"rigid"`` (the torch optimizer's state_dict)."""
    import numpy as np
    import torch

    saved = torch.load(zero_file(checkpoint_dir), map_location="cpu", weights_only=False)["optimizer_state_dict"]
    base = saved["base_optimizer_state"]
    elastic = isinstance(base, list)
    groups = base if elastic else [base["state"][index] for index in sorted(base["state"])]
    state: dict[str, Any] = {
        "layout": "elastic" if elastic else "rigid",
        "weights": np.concatenate([t.detach().float().reshape(-1).numpy()
                                   for t in saved["single_partition_of_fp32_groups"]])}
    for name in ADAM_STATE:
        values = [group[name] for group in groups]
        if name == "step":
            state[name] = np.array([max(float(v) for v in values)])
        else:
            state[name] = np.concatenate([v.detach().float().reshape(-1).numpy() for v in values])
    return state


@dataclass(frozen=True)
class Saved:
    """A job trained ``SAVED_AFTER`` steps and saved: the engine's weights and Adam state when it saved, what the
    ZeRO optimizer file holds, and the folder's files."""

    optimizer: str
    at_save: dict[str, Any]
    in_file: dict[str, Any]
    files: list[str]


def build(job: Any) -> Any:
    """The engine of ``job``: :func:`fixes.harness.build_engine` (a client ``torch.optim.Adam``), or, where the
    job's config has an ``"optimizer"`` block, ``deepspeed.initialize`` with the optimizer the config names."""
    if "optimizer" not in job.config:
        from ...harness import build_engine

        return build_engine(job)
    import deepspeed

    import fixes

    from ...harness import TinyMLP, ds_config

    if job.fixes:
        fixes.apply(*job.fixes)
    model = TinyMLP(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config(job))
    return engine


def trained(job: Any, steps: int = SAVED_AFTER) -> Any:
    """``job``'s engine (:func:`build`) after ``steps`` optimizer steps on the harness's batches."""
    from ...harness import make_batches
    from ...harness.resume import train_steps

    engine = build(job)
    batches = make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch, job.data_seed)
    train_steps(engine, job, batches, range(steps))
    return engine


def save(job: Any, checkpoint_dir: str | None = None) -> Saved:
    """``SAVED_AFTER`` steps of ``job`` through ``deepspeed.initialize``, then ``engine.save_checkpoint``; whatever
    ``save_checkpoint`` raises propagates. The checkpoint goes to a temporary folder unless ``checkpoint_dir``."""
    import numpy as np

    from ...harness.resume import optimizer_state, saved_files

    if checkpoint_dir is None:
        with tempfile.TemporaryDirectory(prefix="fixbook-zero-dim-") as directory:
            return save(job, directory)
    engine = trained(job)
    engine.save_checkpoint(checkpoint_dir)
    inner = engine.optimizer.optimizer
    flat = [p for group in inner.param_groups for p in group["params"]]
    at_save = {"weights": np.concatenate([p.detach().float().reshape(-1).numpy() for p in flat]),
               **optimizer_state(engine.optimizer)}
    return Saved(type(engine.optimizer).__name__, at_save, checkpoint_state(checkpoint_dir),
                 saved_files(checkpoint_dir))


def save_raises(job: Any) -> bool:
    """The grid's check: ``SAVED_AFTER`` steps of ``job``, then ``engine.save_checkpoint``; True if it raises this
    bug's IndexError, False if it saves; CannotTellError where it fails otherwise."""
    engine = trained(job)
    with tempfile.TemporaryDirectory(prefix="fixbook-zero-dim-grid-") as directory:
        try:
            engine.save_checkpoint(directory)
        except IndexError as error:
            if is_this_error(error):
                return True
            raise CannotTellError(f"save_checkpoint failed otherwise: {error}") from error
    return False


def save_fails(job: Any) -> bool:
    """True if ``save_checkpoint`` of ``job`` raises this bug's IndexError; False if it saves and the ZeRO file
    holds the engine's state; CannotTellError otherwise."""
    from ...harness import compare

    try:
        saved = save(job)
    except IndexError as error:
        if is_this_error(error):
            return True
        raise CannotTellError(f"save_checkpoint failed otherwise: {error}") from error
    lengths = {name: saved.in_file[name].size for name in ("weights", *ADAM_STATE)}
    at_save = {name: saved.at_save[name][:lengths[name]] for name in lengths}  # the flat partition's padding
    if not all(compare(saved.in_file[name], at_save[name], job.dtype, name).close for name in lengths):
        raise CannotTellError(f"save_checkpoint saved, but the ZeRO file does not hold the engine's state: "
                              f"{saved.in_file} vs {at_save}")
    return False


def reproduce() -> bool:
    """ZeRO-1, ``elastic_checkpoint``, a client torch Adam: two steps, then ``engine.save_checkpoint``. True if it
    raises ``IndexError: slice() cannot be applied to a 0-dim tensor``; False if it saves a ZeRO optimizer file
    holding the engine's weights and Adam state."""
    return save_fails(elastic_job())


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's job (ZeRO-1, ``elastic_checkpoint``, a client
    torch Adam, ``save_checkpoint``), the same under ZeRO-2, in bf16, and with the config's own Adam with
    ``"torch_adam": true`` (torch's AdamW) instead of a client optimizer: every condition holds in each. Then each
    condition flipped on its own: ZeRO-0 (not ZeRO-3, which refuses ``elastic_checkpoint`` on save with an error of
    its own), and a job that trains and never saves a checkpoint. Not in the grid, because the trigger cannot read
    them from a config (they are in its note): ``elastic_checkpoint`` off (the default) and DeepSpeed's own
    optimizers (FusedAdam, DeepSpeedCPUAdam), whose step count is a Python number."""
    from ...harness import Cell, trigger_job

    def trains_only(job: Any) -> bool:
        trained(job)
        return False  # the job never reaches the code of this bug; training itself does not fail

    def cell(label: str, job: Any, flips: str = "", saves: bool = True) -> Cell:
        return Cell(label, trigger_job(job, uses=("checkpoint-resume",) if saves else ()),
                    (lambda: save_raises(job)) if saves else (lambda: trains_only(job)), flips)

    base = elastic_job()
    torch_adam = {"optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
                  "zero_optimization": {"stage": 1, "elastic_checkpoint": True}}
    return [cell("ZeRO-1, elastic_checkpoint, torch.optim.Adam, save_checkpoint", base),
            cell("the same under ZeRO-2", elastic_job(2)),
            cell("the same in bf16", base.with_(dtype="bfloat16")),
            cell('the config\'s Adam with "torch_adam": true instead', base.with_(config=torch_adam)),
            cell("ZeRO-0 instead", elastic_job(0), "zero_stage"),
            cell("no save_checkpoint: the job only trains", base, "uses:checkpoint-resume", saves=False)]
