"""How load-checkpoint-refresh-fp32-params-missing is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix applied. Imported by the sweep, the tests and the
notebook, never by the fix or its probe.

Also what the notebook shares with it: :func:`warm_start_job` (fp32 without ZeRO, a torch optimizer),
:func:`warm_start` (train, ``save_checkpoint``, a fresh engine, ``load_checkpoint(load_module_only=True)``, train
on), :func:`load_error_is_this_bug`, and :func:`warm_start_reference`, the same warm start in plain PyTorch: the
weights after ``saved_after`` steps, a new optimizer (``load_module_only`` loads no optimizer state), the
remaining steps.
"""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

SAVED_AFTER = 3  # optimizer steps before save_checkpoint
RESUMED_FOR = 3  # optimizer steps after load_checkpoint
LOAD = {"load_module_only": True}
ERROR = "object has no attribute 'refresh_fp32_params'"


def warm_start_job(optimizer: str = "adam", steps: int = SAVED_AFTER + RESUMED_FOR, **changes: Any):
    """fp32, ZeRO stage 0, a torch optimizer (``"adam"`` or ``"sgd"``), lr 0.01, ``steps`` optimizer steps."""
    from ...harness import Job

    return Job(optimizer=optimizer, lr=1e-2, steps=steps).with_(**changes)


def load_error_is_this_bug(error: BaseException) -> bool:
    """The AttributeError ``load_checkpoint`` raises on affected releases."""
    return isinstance(error, AttributeError) and ERROR in str(error)


def warm_start(job: Any, saved_after: int = SAVED_AFTER):
    """``harness.resume.resumed`` with ``load_checkpoint(..., load_module_only=True)``; raises what it raises."""
    from ...harness.resume import resumed

    return resumed(job, saved_after, load=LOAD)


def warm_start_reference(job: Any, saved_after: int = SAVED_AFTER):
    """The warm start in plain PyTorch (one rank, fp32): ``saved_after`` steps, then the same weights under a new
    optimizer for the remaining steps, on the harness's batches. Returns a ``harness.resume.RunState``."""
    import torch

    from ...harness import TinyMLP, make_batches, mse, original_functional_linear
    from ...harness.resume import RunState, optimizer_state
    from ...harness.training import make_optimizer

    with original_functional_linear():
        model = TinyMLP(job.model)
        optimizer = make_optimizer(job, model.parameters())
        batches = make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch, job.data_seed)
        losses = []
        for step in range(job.steps):
            if step == saved_after:  # load_module_only: the weights carry over, the optimizer starts afresh
                optimizer = make_optimizer(job, model.parameters())
            x, y = batches.micro(step, 0, 0)
            loss = mse(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        params = {name: p.detach().float().cpu().numpy().copy() for name, p in model.named_parameters()}
    return RunState(params, optimizer_state(optimizer), losses, type(optimizer).__name__)


def load_fails(job: Any) -> bool:
    """True if ``load_checkpoint(load_module_only=True)`` raises this bug's AttributeError for ``job``, False if
    the warm start runs through; CannotTellError if it fails otherwise."""
    try:
        warm_start(job, min(SAVED_AFTER, job.steps - 1))
    except AttributeError as error:
        if load_error_is_this_bug(error):
            return True
        raise CannotTellError(f"load_checkpoint failed otherwise: {error!r}") from error
    return False


def reproduce() -> bool:
    """fp32 without ZeRO, torch Adam: 3 steps, ``save_checkpoint``, a fresh engine,
    ``load_checkpoint(dir, load_module_only=True)``. True if it raises this bug's AttributeError."""
    return load_fails(warm_start_job(steps=SAVED_AFTER + 1))


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): fp32, ZeRO stage 0, torch Adam, a warm start with
    ``load_module_only=True`` (the sweep's check), the same with SGD (any optimizer the engine keeps as it is).
    Then each condition flipped on its own: bf16 (BF16_Optimizer, which has refresh_fp32_params; not fp16, which has
    its own ZeRO-0 bug, fp16-zero0-loss-scale), ZeRO-1 (the ZeRO optimizer has it), and a job that saves the
    checkpoint and goes on in the same engine (no load). A full ``load_checkpoint`` (``load_module_only=False``) of
    the same job is not in the grid: the trigger cannot read that argument (it is in the trigger's note), and that
    load never reaches the call."""
    from ...harness import Cell, trigger_job

    def cell(label: str, job: Any, flips: str = "", resume: bool = True) -> Cell:
        run = (lambda: load_fails(job)) if resume else (lambda: _saves_without_load(job))
        return Cell(label, trigger_job(job, uses=("checkpoint-resume",) if resume else ()), run, flips)

    base = warm_start_job(steps=SAVED_AFTER + 1)
    return [cell("fp32, ZeRO stage 0, Adam, load_checkpoint(load_module_only=True)", base),
            cell("the same with SGD", base.with_(optimizer="sgd")),
            cell("bf16 instead", base.with_(dtype="bfloat16"), "precision"),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("save_checkpoint, no load: the same engine goes on", base, "uses:checkpoint-resume", resume=False)]


def _saves_without_load(job: Any) -> bool:
    """``save_checkpoint`` after ``SAVED_AFTER`` steps, then the remaining steps in the same engine: False where it
    runs through (no load, nothing for the bug to hit); CannotTellError if it fails."""
    import tempfile

    from ...harness.resume import _batches, train_steps
    from ...harness.training import build_engine

    try:
        with tempfile.TemporaryDirectory(prefix="fixbook-save-") as checkpoint_dir:
            engine = build_engine(job)
            batches = _batches(job)
            train_steps(engine, job, batches, range(SAVED_AFTER))
            engine.save_checkpoint(checkpoint_dir)
            train_steps(engine, job, batches, range(SAVED_AFTER, job.steps))
    except Exception as error:  # noqa: BLE001 - any failure here says nothing about this bug
        raise CannotTellError(f"saving and training on failed: {error!r}") from error
    return False
