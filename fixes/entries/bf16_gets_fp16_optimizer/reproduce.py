"""How bf16-gets-fp16-optimizer is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from ...exceptions import CannotTellError

from typing import Any


def bf16_fp32_accumulation_job(zero_stage: int = 1, optimizer: str = "sgd", steps: int = 2, **changes: Any) -> Any:
    """The harness job of this entry: bf16 with ``grad_accum_dtype: fp32``, and the fp16 block disabled
    so DeepSpeed's defaults apply (dynamic loss scale, 2^16), as in a user's bf16 config."""
    from ...harness import Job

    return Job(zero_stage=zero_stage, dtype="bfloat16", optimizer=optimizer, lr=0.1 if optimizer == "sgd" else 0.01,
               steps=steps, config={"data_types": {"grad_accum_dtype": "fp32"}, "fp16": {"enabled": False}}
               ).with_(**changes)



def reproduce() -> bool:
    """Build a bf16 ZeRO-1 engine with fp32 gradient accumulation (the harness's SGD job): True if it
    is wrapped in an fp16 optimizer rather than BF16_Optimizer."""
    from ...harness import build_engine

    optimizer = type(build_engine(bf16_fp32_accumulation_job(zero_stage=1)).optimizer).__name__
    if optimizer not in ("BF16_Optimizer", "FP16_UnfusedOptimizer", "FP16_Optimizer"):
        raise CannotTellError(f"unexpected optimizer {optimizer} for bf16 ZeRO-1 with fp32 accumulation")
    return optimizer != "BF16_Optimizer"


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ...harness.models import BENCH_MICRO_BATCH, BENCH_MODEL

    return bf16_fp32_accumulation_job(zero_stage=1, optimizer="adam", model=BENCH_MODEL, micro_batch=BENCH_MICRO_BATCH)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): bf16 with fp32 gradient accumulation under ZeRO-1, then each
    condition flipped on its own; each cell builds the engine and tells whether an fp16 optimizer (a loss scale,
    no BF16_Optimizer) wraps the optimizer."""
    from ...harness import Cell, build_engine, trigger_job

    def cell(label: str, job, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job), lambda: type(build_engine(job).optimizer).__name__ in
                    ("FP16_UnfusedOptimizer", "FP16_Optimizer"), flips)

    base = bf16_fp32_accumulation_job(zero_stage=1)
    return [cell("bf16, grad_accum_dtype fp32, ZeRO-1", base),
            cell("fp32 instead", base.with_(dtype="float32", config={}), "precision"),
            cell("bf16 gradient accumulation (the default)", base.with_(config={"fp16": {"enabled": False}}),
                 "grad_accum_dtype"),
            cell("ZeRO-2 instead", base.with_(zero_stage=2), "zero_stage"),
            cell("ZeRO-1 with offload_optimizer to CPU", base.with_(offload=True), "offload_optimizer")]
