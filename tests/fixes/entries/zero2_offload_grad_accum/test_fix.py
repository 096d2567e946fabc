"""zero2-offload-grad-accum on affected releases (both fingerprints) and on the newest (fixed) one."""
import pytest

from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, call_in_release)

FIX_ID = "zero2-offload-grad-accum"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def _job():
    from fixes import harness

    return harness.Job(zero_stage=2, offload=True, micro_steps=3, optimizer="adam", lr=1e-3)


def check_protocol_on_affected_release():
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, _class())


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


def check_drifted_target_raises_and_patches_nothing():
    def async_accumulate_grad_in_cpu_via_gpu(self, param, group_idx=None):  # a new signature, the bug kept
        def accumulate_gradients():
            pass

        def copy_gradients_to_cpu():
            pass

        if self.micro_step_id > 0:
            accumulate_gradients()
        else:
            copy_gradients_to_cpu()

    assert_drift_refused(FIX_ID, _class(), "async_accumulate_grad_in_cpu_via_gpu", async_accumulate_grad_in_cpu_via_gpu)


def check_fixed_release_is_a_noop():
    assert_noop_on_fixed_release(FIX_ID, _class())


@pytest.mark.parametrize("release", ["0.18.2", "0.18.9"])  # the two fingerprints the fix knows
def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact(release):
    call_in_release(release, check_protocol_on_affected_release)


@pytest.mark.parametrize("release", ["0.18.2", "0.18.9"])
def test_when_applied_then_three_micro_steps_with_offload_match_plain_pytorch(release):
    call_in_release(release, check_fix_makes_gradient_accumulation_match_plain_pytorch)


def test_when_target_signature_drifted_then_drift_error_and_nothing_patched():
    call_in_release("0.18.9", check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
