"""How bf16-zero0-checkpoint-drops-optimizer-state is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix applied. Imported by the sweep, the tests and the
notebook, never by the fix or its probe."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

SAVED_AFTER = 3  # N: steps before save_checkpoint
RESUMED_FOR = 3  # M: steps after load_checkpoint
OPTIMIZER_STATE = ("exp_avg", "exp_avg_sq", "step")


def bf16_zero0_job(grad_accum_dtype: str | None = None, **changes: Any) -> Any:
    """bf16, ZeRO stage 0, Adam, N+M steps; the fp16 block disabled so DeepSpeed's defaults apply, as in a
    user's bf16 config. ``grad_accum_dtype``: None (the default, bf16) or "fp32"."""
    from ...harness import Job

    config: dict[str, Any] = {"fp16": {"enabled": False}}
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    return Job(zero_stage=0, dtype="bfloat16", optimizer="adam", lr=0.01, steps=SAVED_AFTER + RESUMED_FOR,
               config=config).with_(**changes)


def load_error_is_this_bug(error: BaseException) -> bool:
    """The first affected release's failure: load_checkpoint asks an fp16 optimizer for what only ZeRO /
    BF16 optimizers have (``_restore_from_bit16_weights``, ``dp_process_group``)."""
    return isinstance(error, AttributeError) and "FP16_" in str(error) and (
        "_restore_from_bit16_weights" in str(error) or "dp_process_group" in str(error))


def reproduce() -> bool:
    """bf16 ZeRO-0 Adam (default gradient accumulation dtype): 3 steps, save_checkpoint, a fresh engine,
    load_checkpoint. True if load_checkpoint raises this bug's AttributeError, or if the fresh engine's
    optimizer state (exp_avg, exp_avg_sq, step) differs from the saving engine's beyond the bf16 tolerance."""
    from ...harness import compare
    from ...harness.resume import resumed

    job = bf16_zero0_job(steps=SAVED_AFTER + 1)
    try:
        run = resumed(job, SAVED_AFTER)
    except AttributeError as error:
        if load_error_is_this_bug(error):
            return True
        raise CannotTellError(f"load_checkpoint failed otherwise: {error}") from error
    if run.at_save.optimizer not in ("FP16_UnfusedOptimizer", "FP16_Optimizer", "BF16_Optimizer"):
        raise CannotTellError(f"unexpected optimizer {run.at_save.optimizer} for bf16 without ZeRO")
    return not all(compare(run.at_load.state[name], run.at_save.state[name], job.dtype, name).close
                   for name in OPTIMIZER_STATE)


def state_lost(job: Any, resume: bool = True) -> bool:
    """``SAVED_AFTER`` steps of ``job``, then ``save_checkpoint``; with ``resume``, a fresh engine and
    ``load_checkpoint`` (``resumed``), else the same engine goes on training (a job that saves checkpoints and
    never resumes from one). True if the optimizer state the next step starts from (exp_avg, exp_avg_sq, step)
    differs from the state the saving engine held beyond the job's dtype tolerance, or if load_checkpoint raises
    this bug's AttributeError; raises CannotTellError where it fails otherwise."""
    from ... import registry

    applied_before = {fix_id for fix_id in job.fixes if registry.get(fix_id).applied}
    try:
        return _state_lost(job, resume)
    finally:  # build_engine applies the job's fixes in this process: the next cell starts without them
        for fix_id in job.fixes:
            if fix_id not in applied_before and registry.get(fix_id).applied:
                registry.revert(fix_id)


def _state_lost(job: Any, resume: bool) -> bool:
    import tempfile

    from ...harness import build_engine, compare, make_batches
    from ...harness.resume import optimizer_state, resumed, train_steps

    if resume:
        try:
            run = resumed(job, SAVED_AFTER)
        except AttributeError as error:
            if load_error_is_this_bug(error):
                return True
            raise CannotTellError(f"load_checkpoint failed otherwise: {error}") from error
        saved, goes_on_with = run.at_save.state, run.at_load.state
    else:
        engine = build_engine(job)
        batches = make_batches(job.model, job.steps, job.micro_batches_per_step, 1, job.micro_batch, job.data_seed)
        train_steps(engine, job, batches, range(SAVED_AFTER))
        saved = optimizer_state(engine.optimizer)
        with tempfile.TemporaryDirectory(prefix="fixbook-trigger-") as checkpoint_dir:
            engine.save_checkpoint(checkpoint_dir)
        goes_on_with = optimizer_state(engine.optimizer)
    return not all(compare(goes_on_with[name], saved[name], job.dtype, name).close for name in OPTIMIZER_STATE)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): bf16 without ZeRO, Adam, resumed after 3 steps (the sweep's
    check), and the same with ``grad_accum_dtype`` fp32, with and without bf16-gets-fp16-optimizer's fix (the
    engine then builds BF16_Optimizer, else FP16_UnfusedOptimizer through that entry's bug): every condition holds
    in each. Then each condition flipped on its own: fp32 (not fp16, which has its own ZeRO-0 bug,
    fp16-zero0-loss-scale), ZeRO-1, and a job that saves the checkpoint but goes on training in the same engine
    (no resume). Each cell tells whether the optimizer state the next step starts from is the one saved
    (:func:`state_lost`)."""
    from ...harness import Cell, trigger_job

    def cell(label: str, job: Any, flips: str = "", resume: bool = True) -> Cell:
        return Cell(label, trigger_job(job, uses=("checkpoint-resume",) if resume else ()),
                    lambda: state_lost(job, resume), flips)

    base = bf16_zero0_job(steps=SAVED_AFTER + 1)
    fp32_accumulation = bf16_zero0_job("fp32", steps=SAVED_AFTER + 1)
    return [cell("bf16, ZeRO stage 0, save_checkpoint and load_checkpoint", base),
            cell("the same with grad_accum_dtype fp32", fp32_accumulation),
            cell("the same with grad_accum_dtype fp32 and bf16-gets-fp16-optimizer's fix (BF16_Optimizer)",
                 fp32_accumulation.with_(fixes=("bf16-gets-fp16-optimizer",))),
            cell("fp32 instead", base.with_(dtype="float32"), "precision"),
            cell("ZeRO-1 instead", base.with_(zero_stage=1), "zero_stage"),
            cell("save_checkpoint, no resume: the same engine goes on", base, "uses:checkpoint-resume", resume=False)]
