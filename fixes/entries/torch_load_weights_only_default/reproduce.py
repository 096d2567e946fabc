"""How torch-load-weights-only-default is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe.

Also what the notebook shares with it: :func:`resume_job` (the user's job), :func:`is_this_error`, :func:`trained`,
:func:`load_fails` (``save_checkpoint`` then ``load_checkpoint`` in a fresh engine) and :func:`convert_fails`
(``save_checkpoint`` then ``get_fp32_state_dict_from_zero_checkpoint``).
"""
from __future__ import annotations

import pickle
import tempfile
from typing import Any

from ...exceptions import CannotTellError

ERROR = "Weights only load failed"
SAVED_AFTER = 1  # optimizer steps before save_checkpoint


def resume_job(stage: int = 1, **changes: Any) -> Any:
    """ZeRO ``stage``, fp32, torch's SGD (the harness's default optimizer), saved after :data:`SAVED_AFTER` step."""
    from ...harness import Job

    return Job(zero_stage=stage, steps=SAVED_AFTER + 1).with_(**changes)


def is_this_error(error: BaseException) -> bool:
    """The bug's error: ``_pickle.UnpicklingError: Weights only load failed. ...``."""
    return isinstance(error, pickle.UnpicklingError) and ERROR in str(error)


def trained(job: Any, steps: int = SAVED_AFTER) -> Any:
    """``job``'s engine (:func:`fixes.harness.build_engine`) after ``steps`` optimizer steps on the harness's
    batches."""
    from ...harness import build_engine, make_batches
    from ...harness.resume import train_steps

    engine = build_engine(job)
    batches = make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch, job.data_seed)
    train_steps(engine, job, batches, range(steps))
    return engine


def load_fails(job: Any) -> bool:
    """:data:`SAVED_AFTER` steps of ``job``, ``engine.save_checkpoint``, a fresh engine ``load_checkpoint``s it. True
    if ``load_checkpoint`` raises this bug's UnpicklingError; False if it loads and the fresh engine holds the saved
    weights; CannotTellError otherwise."""
    from ...harness import build_engine, compare, gathered_params

    engine = trained(job)
    saved = gathered_params(engine.module)
    with tempfile.TemporaryDirectory(prefix="fixbook-weights-only-") as directory:
        engine.save_checkpoint(directory)
        fresh = build_engine(job)
        try:
            load_path, _ = fresh.load_checkpoint(directory)
        except pickle.UnpicklingError as error:
            if is_this_error(error):
                return True
            raise CannotTellError(f"load_checkpoint failed otherwise: {error}") from error
    if load_path is None:
        raise CannotTellError(f"load_checkpoint found no checkpoint in {directory}")
    if not compare(gathered_params(fresh.module), saved, job.dtype, "loaded vs saved").close:
        raise CannotTellError("load_checkpoint loaded, but the fresh engine does not hold the saved weights")
    return False


def convert_fails(job: Any) -> bool:
    """:data:`SAVED_AFTER` steps of ``job``, ``engine.save_checkpoint``, then zero_to_fp32's
    ``get_fp32_state_dict_from_zero_checkpoint``. True if it raises this bug's UnpicklingError; False if it returns
    the trained weights; CannotTellError otherwise."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from ...harness import compare, gathered_params

    engine = trained(job)
    saved = gathered_params(engine.module)
    with tempfile.TemporaryDirectory(prefix="fixbook-weights-only-fp32-") as directory:
        engine.save_checkpoint(directory)
        try:
            converted = get_fp32_state_dict_from_zero_checkpoint(directory)
        except pickle.UnpicklingError as error:
            if is_this_error(error):
                return True
            raise CannotTellError(f"zero_to_fp32 failed otherwise: {error}") from error
    missing = sorted(set(saved) - set(converted))
    if missing or not compare({k: converted[k] for k in saved}, saved, "float32", "converted vs trained").close:
        raise CannotTellError(f"zero_to_fp32 converted, but not the trained weights (missing: {missing})")
    return False


def reproduce() -> bool:
    """ZeRO-1, one SGD step, ``engine.save_checkpoint``; then ``load_checkpoint`` into a fresh engine and
    ``get_fp32_state_dict_from_zero_checkpoint`` of the same kind of checkpoint. True if both raise
    ``UnpicklingError: Weights only load failed``; False if both load the saved weights; CannotTellError where the
    two disagree (a fix or a release that covers one path only)."""
    job = resume_job()
    loads, converts = load_fails(job), convert_fails(job)
    if loads != converts:
        raise CannotTellError(f"load_checkpoint {'fails' if loads else 'loads'} but zero_to_fp32 "
                              f"{'fails' if converts else 'converts'}")
    return loads


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), on this environment's torch (2.6 or newer): the sweep's
    job (ZeRO-1, ``save_checkpoint`` then ``load_checkpoint`` in a fresh engine), the same under ZeRO-2 and ZeRO-3,
    bf16 under ZeRO stage 0 (the BF16 optimizer writes an optimizer file of its own), and ZeRO-2 converted with
    ``get_fp32_state_dict_from_zero_checkpoint`` instead of loaded: every condition holds in each. Then each
    condition flipped on its own: ZeRO stage 0 in fp32 (the checkpoint is one model-states file holding torch's
    optimizer state_dict, tensors and numbers only), and a job that trains and saves but never loads. Not in the
    grid: torch older than 2.6 (this environment has one torch only; where ``torch.load`` defaults to
    ``weights_only=False`` nothing fails: the sweep's rows in the torch-2.3 environment)."""
    from ...harness import Cell, trigger_job

    def saves_only(job: Any) -> bool:
        engine = trained(job)
        with tempfile.TemporaryDirectory(prefix="fixbook-weights-only-grid-") as directory:
            engine.save_checkpoint(directory)
        return False  # the job never reads a checkpoint back: no torch.load of DeepSpeed's

    def cell(label: str, job: Any, flips: str = "", use: str = "checkpoint-resume") -> Cell:
        run = {"checkpoint-resume": lambda: load_fails(job), "zero-to-fp32": lambda: convert_fails(job),
               "": lambda: saves_only(job)}[use]
        return Cell(label, trigger_job(job, uses=(use,) if use else ()), run, flips)

    base = resume_job()
    return [cell("ZeRO-1, save_checkpoint, load_checkpoint", base),
            cell("the same under ZeRO-2", resume_job(2)),
            cell("the same under ZeRO-3", resume_job(3)),
            cell("bf16 under ZeRO stage 0", resume_job(0, dtype="bfloat16")),
            cell("ZeRO-2, get_fp32_state_dict_from_zero_checkpoint instead", resume_job(2), use="zero-to-fp32"),
            cell("ZeRO stage 0 in fp32 instead", resume_job(0), "zero_stage|precision"),
            cell("no load: the job trains and saves only", base, "uses:checkpoint-resume|uses:zero-to-fp32", use="")]
