"""zero2-offload-grad-accum on 0.18.2, in a child process: the target's other fingerprint (the notebook runs the
reproduce release's)."""
from tests.helpers import call_in_release

FIX_ID = "zero2-offload-grad-accum"


def check_fix_makes_gradient_accumulation_match_plain_pytorch():
    import fixes
    from fixes import harness

    harness.setup()
    job = harness.Job(zero_stage=2, offload=True, micro_steps=3, optimizer="adam", lr=1e-3)
    reference = harness.train_reference(job)
    fixes.apply(FIX_ID)
    fixed = harness.train_deepspeed(job)
    harness.assert_close(fixed.params, reference.params, "float32", "fixed: parameters")
    harness.assert_close(fixed.grad_norms, reference.grad_norms, "float32", "fixed: gradient norms")


def test_when_applied_on_the_other_fingerprint_then_three_micro_steps_with_offload_match_plain_pytorch():
    call_in_release("0.18.2", check_fix_makes_gradient_accumulation_match_plain_pytorch)
