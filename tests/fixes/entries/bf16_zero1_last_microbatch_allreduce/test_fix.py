"""bf16-zero1-last-microbatch-allreduce beyond the contract and the notebook (0.18.9, gas 1 and 4 on two ranks vs plain
data parallel): the optimizers it must leave alone, 0.18.4 (BF16_Optimizer here only once bf16-gets-fp16-optimizer is
fixed) and 0.18.2 (before the engine.backward rewrite). Every behavioural check runs two gloo ranks."""
from tests.helpers import call_in_release

FIX_ID = "bf16-zero1-last-microbatch-allreduce"
MASKING_FIX = "bf16-gets-fp16-optimizer"


def _setup():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_zero1_last_microbatch_allreduce import reproduce

    harness.setup()
    return fixes, harness, reproduce


def check_other_optimizers_train_exactly_as_without_the_fix():
    fixes, harness, repro = _setup()
    bf16_zero1 = repro.bf16_zero1_job()
    jobs = {"ZeRO-2, bf16, fp32 accumulation": bf16_zero1.with_(zero_stage=2),
            "ZeRO-1, bf16 accumulation": bf16_zero1.with_(config={}),
            "ZeRO-1, fp32": bf16_zero1.with_(dtype="float32", config={})}
    unfixed = {label: harness.train_deepspeed(job) for label, job in jobs.items()}
    fixes.apply(FIX_ID)
    for label, job in jobs.items():
        fixed = harness.train_deepspeed(job)
        assert fixed.optimizer == unfixed[label].optimizer == "DeepSpeedZeroOptimizer", (label, fixed.optimizer)
        same = harness.compare(fixed.params, unfixed[label].params, "float32", f"{label}: fixed vs unfixed")
        assert same.max_abs_diff == 0.0, same


def check_masked_release_needs_both_fixes():
    from fixes.exceptions import CannotTellError

    fixes, harness, repro = _setup()
    assert fixes.get(FIX_ID).probe().affected and fixes.get(MASKING_FIX).probe().affected
    job = repro.bf16_zero1_job(steps=1)
    try:
        repro.run_two_ranks(job)
    except CannotTellError as exc:
        assert "FP16_UnfusedOptimizer" in str(exc), exc
    else:
        raise AssertionError("the engine built BF16_Optimizer without bf16-gets-fp16-optimizer's fix")
    fixes.apply(MASKING_FIX)  # bf16-gets-fp16-optimizer's fix alone gives BF16_Optimizer, and this bug with it
    harness.assert_differs(repro.run_two_ranks(job)[0]["fp32_grads"][0], repro.reference_fp32_grads(job), "bfloat16",
                           "masking fix only, rank 0")
    fixes.revert(MASKING_FIX)
    [outcome] = fixes.apply(FIX_ID)  # this fix alone applies bf16-gets-fp16-optimizer's first, and reverts it again
    assert outcome.action == "applied" and MASKING_FIX in outcome.message, outcome
    for rank, result in enumerate(repro.run_two_ranks(job)):
        harness.assert_close(result["fp32_grads"][0], repro.reference_fp32_grads(job), "bfloat16", f"both, rank {rank}")
    fixes.revert(FIX_ID)
    assert not fixes.get(MASKING_FIX).applied


def check_release_before_the_rewrite_is_a_noop_and_not_affected():
    fixes, _, repro = _setup()
    # before the first affected release, so out of the contract's reach: bf16-gets-fp16-optimizer's bug is here too
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "not affected" in outcome.message, outcome
    with repro.measurement_context():  # BF16_Optimizer only with bf16-gets-fp16-optimizer's fix
        assert repro.reproduce() is False


def test_when_another_zero_optimizer_then_the_fix_changes_nothing():
    call_in_release("0.18.9", check_other_optimizers_train_exactly_as_without_the_fix)


def test_when_bf16_gets_fp16_optimizer_is_installed_then_the_fix_applies_it_and_repairs_both():
    call_in_release("0.18.4", check_masked_release_needs_both_fixes)


def test_when_release_predates_the_engine_backward_rewrite_then_apply_is_a_noop():
    call_in_release("0.18.2", check_release_before_the_rewrite_is_a_noop_and_not_affected)
