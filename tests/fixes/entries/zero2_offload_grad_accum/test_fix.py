"""zero2-offload-grad-accum on affected releases (both fingerprints) and on the newest (fixed) one."""
import pytest

from tests.helpers import call_in_release

FIX_ID = "zero2-offload-grad-accum"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def _job():
    from fixes import harness

    return harness.Job(zero_stage=2, offload=True, micro_steps=3, optimizer="adam", lr=1e-3)


def check_fix_makes_gradient_accumulation_match_plain_pytorch():
    import fixes
    from fixes import harness

    _class()
    reference = harness.train_reference(_job())
    harness.assert_differs(harness.train_deepspeed(_job()).params, reference.params, "float32", "unfixed")
    fixes.apply(FIX_ID)
    fixed = harness.train_deepspeed(_job())
    harness.assert_close(fixed.params, reference.params, "float32", "fixed: parameters")
    harness.assert_close(fixed.grad_norms, reference.grad_norms, "float32", "fixed: gradient norms")


@pytest.mark.parametrize("release", ["0.18.2", "0.18.9"])
def test_when_applied_then_three_micro_steps_with_offload_match_plain_pytorch(release):
    call_in_release(release, check_fix_makes_gradient_accumulation_match_plain_pytorch)
