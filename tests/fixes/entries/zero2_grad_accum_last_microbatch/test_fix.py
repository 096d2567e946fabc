"""zero2-grad-accum-last-microbatch on an affected release (0.18.2) and on the newest (fixed) one."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, call_in_release)

AFFECTED = "0.18.2"
FIX_ID = "zero2-grad-accum-last-microbatch"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def check_protocol_on_affected_release():
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, _class())


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


def check_drifted_target_raises_and_patches_nothing():
    def independent_gradient_partition_epilogue(self, comm_dtype=None):  # a new signature, the bug kept
        for i, _ in enumerate(self.bit16_groups):
            if i not in self.averaged_gradients or self.averaged_gradients[i] is None:
                self.all_grad_tensors[i] = None

    assert_drift_refused(FIX_ID, _class(), "independent_gradient_partition_epilogue",
                         independent_gradient_partition_epilogue)


def check_fixed_release_is_a_noop():
    assert_noop_on_fixed_release(FIX_ID, _class())


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_zero2_accumulation_matches_plain_pytorch():
    call_in_release(AFFECTED, check_fix_makes_zero2_accumulation_match_plain_pytorch_and_revert_brings_the_bug_back)


def test_when_target_signature_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
