"""zero3-fp32-grad-accum-through-bf16 on its reproduce release (0.19.0): jobs whose dtypes need no cast are left bit
for bit as they were (the notebook verifies the jobs that need one)."""
import numpy as np

from fixes import harness
from tests.helpers import call_in_release

FIX_ID = "zero3-fp32-grad-accum-through-bf16"


def check_fix_changes_nothing_where_dtypes_agree():
    """bf16 communication (the default), bf16 gradient accumulation (the default), fp32 training."""
    from fixes.entries.zero3_fp32_grad_accum_through_bf16 import reproduce as repro

    harness.setup()
    base = repro.zero3_job(steps=1)
    for label, job in {"bf16 communication": base.with_(config={"data_types": {"grad_accum_dtype": "fp32"}}),
                       "bf16 accumulation": base.with_(config={"communication_data_type": "fp32"}),
                       "fp32 training": base.with_(dtype="float32")}.items():
        as_is = repro.first_step_grads(job)
        fixed = repro.first_step_grads(job.with_(fixes=(FIX_ID,)))
        for got, want in zip(fixed, as_is):
            for name in want:
                assert np.array_equal(got[name], want[name]), f"{label}: {name} changed by the fix"


def test_when_dtypes_need_no_cast_then_the_fix_changes_no_gradient():
    call_in_release("0.19.0", check_fix_changes_nothing_where_dtypes_agree)
