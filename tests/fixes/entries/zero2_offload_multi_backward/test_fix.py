"""zero2-offload-multi-backward in child processes: on 0.16.6, whose target differs only in the overflow-tracker call
it makes, and with the required fix already applied by the user."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
OLDER_AFFECTED = "0.16.6"  # copy_grads_in_partition has another fingerprint before 0.17.1
FIX_ID = "zero2-offload-multi-backward"
REQUIRED = "zero2-offload-grad-accum"


def check_fix_makes_multiple_backwards_match_plain_pytorch():
    import fixes
    from fixes import harness

    harness.setup()
    [outcome] = fixes.apply(FIX_ID)
    assert REQUIRED in outcome.message and fixes.get(REQUIRED).applied, outcome
    for backwards in (2, 3):
        job = harness.Job(zero_stage=2, offload=True, backwards=backwards, optimizer="adam", lr=1e-3)
        run = harness.versus_reference(f"{backwards} backwards", job)
        harness.assert_close(run.deepspeed.params, run.reference.params, "float32", run.params.name)
        harness.assert_close(run.deepspeed.grad_norms, run.reference.grad_norms, "float32", run.grad_norms.name)


def check_required_fix_applied_by_the_user_stays_after_revert():
    import fixes
    from fixes.harness import setup

    setup()
    fixes.apply(REQUIRED)
    [outcome] = fixes.apply(FIX_ID)
    assert "also applied" not in outcome.message
    fixes.revert(FIX_ID)
    assert fixes.get(REQUIRED).applied


def test_when_applied_on_0_16_then_two_and_three_backwards_match_plain_pytorch():
    call_in_release(OLDER_AFFECTED, check_fix_makes_multiple_backwards_match_plain_pytorch)


def test_when_user_applied_the_required_fix_then_revert_leaves_it():
    call_in_release(AFFECTED, check_required_fix_applied_by_the_user_stays_after_revert)
