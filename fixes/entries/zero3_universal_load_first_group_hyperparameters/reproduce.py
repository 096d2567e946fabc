"""How zero3-universal-load-first-group-hyperparameters is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix of its own applied. Imported by the sweep, the tests and the
notebook, never by the fix or its probe.

The user's job: ZeRO-3 on one rank, torch's AdamW with the Hugging Face Trainer's two parameter groups (weights: lr
and weight decay; biases: half the lr, no weight decay), :data:`SAVED_AFTER` steps, ``save_checkpoint``, the
conversion to a universal checkpoint (``ds_to_universal``'s ``main`` in this process), a fresh engine with
``"checkpoint": {"load_universal": true}`` loads it and trains to :data:`STEPS`; plain PyTorch trains the same steps
uninterrupted.

Before 0.18.0 such a checkpoint (two groups are two ZeRO-3 sub-groups) cannot be converted or loaded at all: entry
ds-to-universal-zero3-sub-groups. The sweep measures this entry there with that entry's fix applied
(:func:`measurement_context`), whose loader keeps each group's own hyperparameters.
"""
from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Iterator

from ...exceptions import CannotTellError

STEPS = 4  # optimizer steps in all
SAVED_AFTER = 2  # the checkpoint is saved after this many; the resumed engine runs the rest
LR, WEIGHT_DECAY = 0.05, 0.1
PREREQUISITE = "ds-to-universal-zero3-sub-groups"  # its bug stops the conversion and the load before 0.18.0


def job(dtype: str = "float32", zero_stage: int = 3, **changes: Any):
    """The user's job: ZeRO-3, fp32, :data:`STEPS` steps, ``load_universal`` for the resume."""
    from ...harness import Job

    return Job(zero_stage=zero_stage, dtype=dtype, steps=STEPS, lr=LR,
               config={"checkpoint": {"load_universal": True}}).with_(**changes)


def trainer_groups(model, groups: int = 2) -> list[dict[str, Any]]:
    """The Hugging Face Trainer's split: weights with lr and weight decay, biases with half the lr and none (one
    group, ``groups=1``: every parameter with lr and weight decay)."""
    named = list(model.named_parameters())
    if groups == 1:
        return [{"params": [p for _, p in named], "lr": LR, "weight_decay": WEIGHT_DECAY}]
    return [{"params": [p for n, p in named if not n.endswith("bias")], "lr": LR, "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": LR / 2, "weight_decay": 0.0}]


def make_optimizer(groups: int = 2):
    import torch

    return lambda model: torch.optim.AdamW(trainer_groups(model, groups))


def user_script(checkpoint_dir: str, run, groups: int = 2, universal: bool = True) -> dict[str, Any]:
    """The user's job, one rank: ``deepspeed.initialize`` with AdamW over the groups, :data:`SAVED_AFTER` steps,
    ``save_checkpoint``, (``universal``) the conversion, a fresh engine loads it and trains to ``run.steps``.
    Returns {"saved": each group's (lr, weight_decay) when saved, "loaded": right after loading, "params": the
    final weights}; whatever the conversion or the load raises propagates."""
    import deepspeed

    from ...harness import TinyMLP, device, ds_config, dtype_of, gathered_params, make_batches, mse
    from ...harness.universal import convert

    config = ds_config(run) if universal else {**ds_config(run), "checkpoint": {}}
    batches, optimizer = make_batches(run.model, run.steps), make_optimizer(groups)

    def build():
        model = TinyMLP(run.model)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model), config=config)
        return engine

    def train(engine, steps: range) -> None:
        for step in steps:
            x, y = batches.micro(step, 0, 0)
            engine.backward(mse(engine(x.to(device(), dtype_of(run.dtype))), y.to(device())))
            engine.step()

    def hyperparameters(engine) -> list[tuple[float, float]]:
        return [(float(g["lr"]), float(g["weight_decay"])) for g in engine.optimizer.param_groups]

    engine = build()
    train(engine, range(SAVED_AFTER))
    saved = hyperparameters(engine)
    engine.save_checkpoint(checkpoint_dir)
    if universal:
        convert(checkpoint_dir, inject_missing_state=run.zero_stage in (1, 2))
    engine = build()
    if engine.load_checkpoint(checkpoint_dir)[0] is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {checkpoint_dir}")
    loaded = hyperparameters(engine)
    train(engine, range(SAVED_AFTER, run.steps))
    return {"saved": saved, "loaded": loaded, "params": gathered_params(engine.module)}


def outcome(run, groups: int = 2, universal: bool = True) -> dict[str, Any]:
    """:func:`user_script` against plain PyTorch trained uninterrupted: {"saved", "loaded" (each group's lr and
    weight decay), "weights" (the final weights' comparison)}; CannotTellError where the checkpoint cannot be
    made or loaded."""
    from ...harness import compare, train_reference

    reference = train_reference(run, build_optimizer=make_optimizer(groups))
    with tempfile.TemporaryDirectory(prefix="fixbook-zero3-universal-groups-") as checkpoint_dir:
        try:
            resumed = user_script(checkpoint_dir, run, groups, universal)
        except Exception as error:  # noqa: BLE001 - a failure to convert or load says nothing about the groups
            raise CannotTellError(f"the checkpoint could not be made or loaded: {type(error).__name__}: "
                                  f"{error}".splitlines()[0][:300]) from error
    label = f"ZeRO-{run.zero_stage}, {groups} group(s), {run.dtype}"
    return {"saved": resumed["saved"], "loaded": resumed["loaded"],
            "weights": compare(resumed["params"], reference.params, run.dtype, f"[{label}] resumed weights vs PyTorch")}


def shows(run, groups: int = 2, universal: bool = True) -> bool:
    """True if a group's lr or weight decay after loading is not the one saved, or the resumed weights differ from
    plain PyTorch beyond the dtype's tolerance."""
    found = outcome(run, groups, universal)
    return found["loaded"] != found["saved"] or not found["weights"].close


def reproduce() -> bool:
    """ZeRO-3, AdamW with the Trainer's two groups, save, convert, load, resume (:func:`shows`), inside
    :func:`measurement_context`."""
    return shows(job())


@contextlib.contextmanager
def measurement_context() -> Iterator[None]:
    """Where DeepSpeed has :data:`PREREQUISITE`'s bug (0.16.0 - 0.17.6), that entry's fix applied, so that a
    universal checkpoint with several sub-groups can be made and loaded at all; elsewhere the installed code."""
    from ...harness.entry import fixed_where_installed

    with fixed_where_installed(PREREQUISITE):
        yield


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the user's job, then one parameter group instead, a
    plain checkpoint instead of a universal one, and ZeRO-2 instead (its universal loader reads each group's own)."""
    from ...harness import Cell, trigger_job

    universal, groups = "ds-to-universal", "param-groups"

    def cell(label: str, run, used: tuple[str, ...], flips: str = "", count: int = 2, converted: bool = True) -> Cell:
        return Cell(label, trigger_job(run, uses=used), lambda: shows(run, count, converted), flips)

    base = job()
    return [cell("ZeRO-3, AdamW with two parameter groups, a universal checkpoint", base, (universal, groups)),
            cell("one parameter group instead", base, (universal,), f"uses:{groups}", count=1),
            cell("a plain checkpoint instead of a universal one", base, (groups,), f"uses:{universal}",
                 converted=False),
            cell("ZeRO-2 instead", base.with_(zero_stage=2), (universal, groups), "zero_stage")]
