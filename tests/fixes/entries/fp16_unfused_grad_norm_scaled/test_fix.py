"""What is specific to fp16-unfused-grad-norm-scaled, in child processes of a release (``call_in_release``). Every check
every entry must pass (metadata, probe against the sweep, apply/revert exact, drift refused, no-op where unaffected, its
trigger and notebook) is tests/fixes/test_contract.py's: it runs on this entry with nothing written here."""
from tests.helpers import call_in_release

AFFECTED = "0.18.2"  # engine.backward scales the loss through the optimizer: the bug shows alone
MASKED = "0.19.8"  # engine.backward does not scale the fp16 loss (entry fp16-zero0-loss-scale): it hides this bug
FIX_ID = "fp16-unfused-grad-norm-scaled"
MASKING = "fp16-zero0-loss-scale"


def check_the_step_is_unchanged_and_only_the_report_is_unscaled():
    """With clipping that clips, the trained weights with the fix are those without it, bit for bit; the report is
    the unscaled norm."""
    import fixes
    from fixes import harness

    harness.setup()
    harness.allow_fp16_on_cpu()
    job = harness.Job(zero_stage=0, dtype="float16", optimizer="sgd", steps=2, config={"gradient_clipping": 0.5})
    before = harness.train_deepspeed(job)
    assert fixes.apply(FIX_ID)[0].action == "applied"
    after = harness.train_deepspeed(job)
    assert all((before.params[k] == after.params[k]).all() for k in before.params), "the fix changed the step"
    scale = 128.0
    assert after.grad_norms == [norm / scale for norm in before.grad_norms], (before.grad_norms, after.grad_norms)
    reference = harness.train_reference(job)  # it does not clip: only the first step's gradients are the same
    harness.assert_close(after.grad_norms[:1], reference.grad_norms[:1], "float16", "the first step's reported norm")


def check_an_overflowed_step_keeps_the_norm_the_release_leaves():
    """A step whose scaled gradients overflow is skipped (the dynamic scale halves); the fix leaves the norm that
    step stores as the release leaves it (it divides only a step that was taken)."""
    import torch

    import fixes
    from fixes import harness

    harness.setup()
    harness.allow_fp16_on_cpu()
    dynamic = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 7}}

    def overflowed_norm():
        engine = harness.build_engine(harness.Job(zero_stage=0, dtype="float16", optimizer="sgd", config=dynamic))
        engine.backward(harness.mse(engine(torch.ones(4, 8, dtype=torch.float16)), torch.zeros(4, 4)))
        for param in engine.module.parameters():
            param.grad.fill_(float("inf"))
        engine.step()
        assert engine.optimizer.overflow and engine.optimizer.cur_scale == 64, engine.optimizer.cur_scale
        return engine.optimizer._global_grad_norm

    unfixed = overflowed_norm()
    assert fixes.apply(FIX_ID)[0].action == "applied"
    assert overflowed_norm() == unfixed


def check_on_a_masked_release_the_fix_brings_the_loss_scale_fix_and_reports_the_true_norm():
    import fixes
    from fixes import harness

    harness.setup()
    harness.allow_fp16_on_cpu()
    assert fixes.get(MASKING).probe().affected
    job = harness.Job(zero_stage=0, dtype="float16", optimizer="sgd", steps=2)
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and MASKING in outcome.message and fixes.get(MASKING).applied, outcome
    ds, ref = harness.train_deepspeed(job), harness.train_reference(job)
    harness.assert_close(ds.grad_norms, ref.grad_norms, "float16", "reported norm with both fixes")
    harness.assert_close(ds.params, ref.params, "float16", "weights with both fixes")
    fixes.revert(FIX_ID)
    assert not fixes.get(MASKING).applied and not fixes.get(FIX_ID).applied


def test_when_the_fix_is_applied_then_the_step_is_unchanged_and_the_reported_norm_is_unscaled():
    call_in_release(AFFECTED, check_the_step_is_unchanged_and_only_the_report_is_unscaled)


def test_when_a_step_overflows_then_the_fix_leaves_its_norm_alone():
    call_in_release(AFFECTED, check_an_overflowed_step_keeps_the_norm_the_release_leaves)


def test_when_the_loss_scale_bug_hides_it_then_applying_the_fix_applies_both_and_reports_the_true_norm():
    call_in_release(MASKED, check_on_a_masked_release_the_fix_brings_the_loss_scale_fix_and_reports_the_true_norm)
