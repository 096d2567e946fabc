"""zero2-offload-multi-backward on affected releases (0.18.9; 0.16.6, whose target differs only in the
overflow-tracker call it makes) and on the newest (fixed) one."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.18.9"
OLDER_AFFECTED = "0.16.6"  # copy_grads_in_partition has another fingerprint before 0.17.1
FIX_ID = "zero2-offload-multi-backward"
REQUIRED = "zero2-offload-grad-accum"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def _job(backwards):
    from fixes import harness

    return harness.Job(zero_stage=2, offload=True, backwards=backwards, optimizer="adam", lr=1e-3)


def check_fix_makes_multiple_backwards_match_plain_pytorch():
    import fixes
    from fixes import harness

    _class()
    [outcome] = fixes.apply(FIX_ID)
    assert REQUIRED in outcome.message and fixes.get(REQUIRED).applied, outcome
    for backwards in (2, 3):
        run = harness.versus_reference(f"{backwards} backwards", _job(backwards))
        harness.assert_close(run.deepspeed.params, run.reference.params, "float32", run.params.name)
        harness.assert_close(run.deepspeed.grad_norms, run.reference.grad_norms, "float32", run.grad_norms.name)
    fixes.revert(FIX_ID)
    assert not fixes.get(REQUIRED).applied


def check_required_fix_applied_by_the_user_stays_after_revert():
    import fixes

    _class()
    fixes.apply(REQUIRED)
    [outcome] = fixes.apply(FIX_ID)
    assert "also applied" not in outcome.message
    fixes.revert(FIX_ID)
    assert fixes.get(REQUIRED).applied


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    def copy_grads_in_partition(self, param, group_idx=None):  # 0.19.x grew group_idx; the bug kept
        if self.cpu_offload:
            if self.gradient_accumulation_steps > 1:
                self.async_accumulate_grad_in_cpu_via_gpu(param)

    assert_drift_refused(FIX_ID, _class(), "copy_grads_in_partition", copy_grads_in_partition)
    assert not fixes.get(REQUIRED).applied  # drift is found before the required fix is applied


def test_when_applied_then_two_and_three_backwards_match_plain_pytorch():
    call_in_release(AFFECTED, check_fix_makes_multiple_backwards_match_plain_pytorch)


def test_when_applied_on_0_16_then_two_and_three_backwards_match_plain_pytorch():
    call_in_release(OLDER_AFFECTED, check_fix_makes_multiple_backwards_match_plain_pytorch)


def test_when_user_applied_the_required_fix_then_revert_leaves_it():
    call_in_release(AFFECTED, check_required_fix_applied_by_the_user_stays_after_revert)


def test_when_target_signature_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
