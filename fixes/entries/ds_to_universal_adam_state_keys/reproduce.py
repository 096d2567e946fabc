"""How ds-to-universal-adam-state-keys is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

The user's job: ZeRO-2 (or 1) with torch's SGD on one rank, :data:`SAVED_AFTER` steps, ``save_checkpoint``, the
conversion to a universal checkpoint (``ds_to_universal``'s ``main`` in this process, as ``python -m
deepspeed.checkpoint.ds_to_universal --inject_missing_state`` runs it), a fresh engine with ``"checkpoint":
{"load_universal": true}`` loads it and trains to :data:`STEPS`; plain PyTorch trains the same steps uninterrupted.
"""
from __future__ import annotations

import tempfile
import traceback
from typing import Any

from ...exceptions import CannotTellError

STEPS = 4  # optimizer steps in all
SAVED_AFTER = 2  # the checkpoint is saved after this many; the resumed engine runs the rest
LOAD_UNIVERSAL = {"checkpoint": {"load_universal": True}}  # read by load_checkpoint only


def job(zero_stage: int = 2, optimizer: str = "sgd", dtype: str = "float32", **changes: Any):
    """The user's job: ZeRO-2, torch's SGD (no momentum: no optimizer state at all), fp32, :data:`STEPS` steps."""
    from ...harness import Job

    return Job(zero_stage=zero_stage, optimizer=optimizer, dtype=dtype, steps=STEPS, config=LOAD_UNIVERSAL,
               lr=0.05).with_(**changes)


def to_universal(checkpoint_dir: str) -> str:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder <dir>/<latest tag> --inject_missing_state``,
    in this process (:func:`fixes.harness.universal.convert`: a fix applied here takes part)."""
    from ...harness.universal import convert

    return convert(checkpoint_dir, inject_missing_state=True)


def make_optimizer(run, momentum: float = 0.0):
    """The job's torch optimizer: SGD (``momentum``: its momentum, 0 keeps no state) or, for ``run.optimizer ==
    "adam"``, Adam."""
    import torch

    if run.optimizer == "adam":
        return lambda model: torch.optim.Adam(model.parameters(), lr=run.lr)
    return lambda model: torch.optim.SGD(model.parameters(), lr=run.lr, momentum=momentum)


def user_script(checkpoint_dir: str, run, momentum: float = 0.0) -> dict[str, Any]:
    """The user's job, one rank: ``deepspeed.initialize`` with the torch optimizer, :data:`SAVED_AFTER` steps,
    ``save_checkpoint``, the conversion (:func:`to_universal`), a fresh engine with ``load_universal`` loads it and
    trains to ``run.steps``. Returns {"params": the final weights, "losses": every step's}; whatever the conversion
    or the load raises propagates."""
    import deepspeed

    from ...harness import TinyMLP, device, ds_config, dtype_of, gathered_params, make_batches, mse

    config, optimizer = ds_config(run), make_optimizer(run, momentum)
    batches = make_batches(run.model, run.steps)

    def build():
        model = TinyMLP(run.model)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model), config=config)
        return engine

    def train(engine, steps: range) -> list[float]:
        losses = []
        for step in steps:
            x, y = batches.micro(step, 0, 0)
            loss = mse(engine(x.to(device(), dtype_of(run.dtype))), y.to(device()))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        return losses

    engine = build()
    losses = train(engine, range(SAVED_AFTER))
    engine.save_checkpoint(checkpoint_dir)
    to_universal(checkpoint_dir)
    engine = build()
    if engine.load_checkpoint(checkpoint_dir)[0] is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {checkpoint_dir}")
    losses += train(engine, range(SAVED_AFTER, run.steps))
    return {"params": gathered_params(engine.module), "losses": losses}


def is_the_bug(error: BaseException) -> bool:
    """Whether ``error`` is this bug's: ``KeyError: 'exp_avg'`` raised in ``ds_to_universal.extract_zero_shards``."""
    names = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    return isinstance(error, KeyError) and error.args == ("exp_avg",) and "extract_zero_shards" in names


def outcome(run, momentum: float = 0.0) -> dict[str, Any]:
    """:func:`user_script` against plain PyTorch trained the same steps uninterrupted: {"error": the conversion's
    or load's error line ("" if none), "bug": whether it is this bug's, "weights": the comparison of the final
    weights with plain PyTorch's (None where it did not run)}."""
    from ...harness import compare, train_reference

    reference = train_reference(run, build_optimizer=make_optimizer(run, momentum))
    with tempfile.TemporaryDirectory(prefix="fixbook-universal-state-keys-") as checkpoint_dir:
        try:
            resumed = user_script(checkpoint_dir, run, momentum)
        except Exception as error:  # noqa: BLE001 - recorded: the bug's KeyError, or another failure
            return {"error": f"{type(error).__name__}: {error}".splitlines()[0][:300], "bug": is_the_bug(error),
                    "weights": None}
    label = f"ZeRO-{run.zero_stage}, {run.optimizer}{f' (momentum {momentum})' if momentum else ''}, {run.dtype}"
    return {"error": "", "bug": False,
            "weights": compare(resumed["params"], reference.params, run.dtype, f"[{label}] resumed weights vs PyTorch")}


def shows(run) -> bool:
    """True if the conversion fails with this bug's KeyError, or the resumed run ends away from plain PyTorch;
    CannotTellError where the conversion or the load fails otherwise."""
    found = outcome(run)
    if found["error"] and not found["bug"]:
        raise CannotTellError(f"the universal checkpoint could not be made or loaded: {found['error']}")
    return found["bug"] or not found["weights"].close


def reproduce() -> bool:
    """ZeRO-2, SGD, two steps, save, convert, load, two more (:func:`shows`)."""
    return shows(job())


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the user's job (ZeRO-2, SGD, converted to a universal
    checkpoint), ZeRO-1 instead (also in the trigger), then Adam instead of SGD, and a plain checkpoint instead of a
    universal one (the load reads the saved files directly): each flips one condition."""
    from ...harness import Cell, trigger_job

    universal, no_adam = "ds-to-universal", "optimizer-without-adam-state"

    def cell(label: str, run, used: tuple[str, ...], flips: str = "", check=shows) -> Cell:
        return Cell(label, trigger_job(run, uses=used), lambda: check(run), flips)

    def plain_resume_differs(run) -> bool:  # save_checkpoint and load_checkpoint of the checkpoint itself
        from ...harness import compare
        from ...harness.resume import reference, resumed

        plain = run.with_(config={})
        return not compare(resumed(plain, SAVED_AFTER).end.params, reference(plain).params, run.dtype).close

    base = job()
    return [cell("ZeRO-2, torch SGD, a universal checkpoint", base, (universal, no_adam)),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), (universal, no_adam)),
            cell("torch Adam instead of SGD", base.with_(optimizer="adam"), (universal,), f"uses:{no_adam}"),
            cell("a plain checkpoint instead of a universal one", base, (no_adam,), f"uses:{universal}",
                 plain_resume_differs)]
