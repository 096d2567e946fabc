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
