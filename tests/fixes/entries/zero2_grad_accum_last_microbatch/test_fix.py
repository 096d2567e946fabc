"""zero2-grad-accum-last-microbatch on an affected release (0.18.2) and on the newest (fixed) one."""
from tests.helpers import call_in_release

AFFECTED = "0.18.2"
FIX_ID = "zero2-grad-accum-last-microbatch"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def check_fix_makes_zero2_accumulation_match_plain_pytorch_and_revert_brings_the_bug_back():
    import fixes
    from fixes import harness

    _class()
    job = harness.Job(zero_stage=2, micro_steps=3)
    reference = harness.train_reference(job)
    harness.assert_close(harness.train_deepspeed(job).params, harness.train_reference(job, keep=(2,)).params,
                         "float32", "unfixed equals last micro-batch only")
    fixes.apply(FIX_ID)
    run = harness.versus_reference("fixed", job)
    harness.assert_close(run.deepspeed.params, reference.params, "float32", "fixed: parameters")
    harness.assert_close(run.deepspeed.grad_norms, reference.grad_norms, "float32", "fixed: gradient norms")
    fixes.revert(FIX_ID)
    harness.assert_differs(harness.train_deepspeed(job).params, reference.params, "float32", "reverted")


def test_when_applied_then_zero2_accumulation_matches_plain_pytorch():
    call_in_release(AFFECTED, check_fix_makes_zero2_accumulation_match_plain_pytorch_and_revert_brings_the_bug_back)
