"""bf16-zero1-last-microbatch-allreduce on its reproduce release (0.18.9), on 0.18.4 (where the engine builds
BF16_Optimizer for this configuration only once bf16-gets-fp16-optimizer is fixed), on 0.18.2 (before the
engine.backward rewrite) and on the newest (fixed) one. Every behavioural check runs two gloo ranks."""
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.9"
MASKED = "0.18.4"  # affected code, but bf16-gets-fp16-optimizer's bug builds FP16_UnfusedOptimizer instead
BEFORE_REWRITE = "0.18.2"
FIX_ID = "bf16-zero1-last-microbatch-allreduce"
MASKING_FIX = "bf16-gets-fp16-optimizer"


def _engine_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _two_rank_gradients(job):
    """(the two ranks' results, the first step's plain-PyTorch data-parallel gradient)."""
    from fixes.entries.bf16_zero1_last_microbatch_allreduce import reproduce as repro

    return repro.run_two_ranks(job), repro.reference_fp32_grads(job)


def check_bug_is_the_unreduced_last_micro_batch_and_the_fix_matches_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_zero1_last_microbatch_allreduce import reproduce as repro

    _engine_class()
    job = repro.bf16_zero1_job()
    ranks, expected = _two_rank_gradients(job)
    for rank, result in enumerate(ranks):
        grads = result["fp32_grads"][0]
        harness.assert_differs(grads, expected, "bfloat16", f"rank {rank} fp32 gradient vs plain data parallel")
        harness.assert_close(grads, repro.reference_fp32_grads(job, last_micro_batch_of=rank), "bfloat16",
                             f"rank {rank} fp32 gradient vs its own last micro-batch left out of the all-reduce")
    harness.assert_differs(ranks[0]["fp32_grads"][0], ranks[1]["fp32_grads"][0], "bfloat16", "rank 0 vs rank 1")
    reference = harness.train_reference(job, world_size=2)
    harness.assert_differs(ranks[0]["params"], reference.params, "bfloat16", "unfixed parameters vs plain PyTorch")

    fixes.apply(FIX_ID)
    fixed, _ = _two_rank_gradients(job)
    for rank, result in enumerate(fixed):
        for step, grads in enumerate(result["fp32_grads"][:1]):
            harness.assert_close(grads, expected, "bfloat16", f"fixed rank {rank} fp32 gradient, step {step}")
        harness.assert_close(result["params"], reference.params, "bfloat16", f"fixed rank {rank} parameters")
    harness.assert_close(fixed[0]["fp32_grads"][1], fixed[1]["fp32_grads"][1], "float32", "fixed ranks, step 1")
    fixes.revert(FIX_ID)
    assert repro.reproduce() is True


def check_other_optimizers_train_exactly_as_without_the_fix():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_zero1_last_microbatch_allreduce import reproduce as repro

    _engine_class()
    bf16_zero1 = repro.bf16_zero1_job()
    jobs = {"DeepSpeedZeroOptimizer (ZeRO-2, bf16, fp32 accumulation)": bf16_zero1.with_(zero_stage=2),
            "DeepSpeedZeroOptimizer (ZeRO-1, bf16 accumulation)": bf16_zero1.with_(config={}),
            "DeepSpeedZeroOptimizer (ZeRO-1, fp32)": bf16_zero1.with_(dtype="float32", config={})}
    unfixed = {label: harness.train_deepspeed(job) for label, job in jobs.items()}
    fixes.apply(FIX_ID)
    for label, job in jobs.items():
        fixed = harness.train_deepspeed(job)
        assert fixed.optimizer == unfixed[label].optimizer == "DeepSpeedZeroOptimizer", (label, fixed.optimizer)
        same = harness.compare(fixed.params, unfixed[label].params, "float32", f"{label}: fixed vs unfixed")
        assert same.max_abs_diff == 0.0, same
    fixes.revert(FIX_ID)


def check_masked_release_needs_both_fixes():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_zero1_last_microbatch_allreduce import reproduce as repro
    from fixes.exceptions import CannotTellError

    _engine_class()
    fix = fixes.get(FIX_ID)
    assert fix.probe().affected and fixes.get(MASKING_FIX).probe().affected
    job = repro.bf16_zero1_job(steps=1)
    try:
        repro.run_two_ranks(job)
    except CannotTellError as exc:
        assert "FP16_UnfusedOptimizer" in str(exc), exc
    else:
        raise AssertionError("the engine built BF16_Optimizer without bf16-gets-fp16-optimizer's fix")
    # bf16-gets-fp16-optimizer's fix alone gives BF16_Optimizer, and this bug with it
    fixes.apply(MASKING_FIX)
    ranks, expected = _two_rank_gradients(job)
    harness.assert_differs(ranks[0]["fp32_grads"][0], expected, "bfloat16", "masking fix only, rank 0")
    fixes.revert(MASKING_FIX)
    # this fix alone applies bf16-gets-fp16-optimizer's first, and reverts it again
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and MASKING_FIX in outcome.message, outcome
    ranks, expected = _two_rank_gradients(job)
    for rank, result in enumerate(ranks):
        harness.assert_close(result["fp32_grads"][0], expected, "bfloat16", f"both fixes, rank {rank}")
    fixes.revert(FIX_ID)
    assert not fixes.get(MASKING_FIX).applied


def check_release_before_the_rewrite_is_a_noop_and_not_affected():
    from fixes.entries.bf16_zero1_last_microbatch_allreduce import reproduce as repro

    assert_noop_on_fixed_release(FIX_ID, _engine_class())
    # bf16-gets-fp16-optimizer's bug is installed here too: BF16_Optimizer only with its fix
    with repro.measurement_context():
        assert repro.reproduce() is False


def test_when_two_ranks_then_last_micro_batch_is_not_reduced_and_the_fix_matches_plain_pytorch():
    call_in_release(AFFECTED, check_bug_is_the_unreduced_last_micro_batch_and_the_fix_matches_plain_pytorch)


def test_when_another_zero_optimizer_then_the_fix_changes_nothing():
    call_in_release(AFFECTED, check_other_optimizers_train_exactly_as_without_the_fix)


def test_when_bf16_gets_fp16_optimizer_is_installed_then_the_fix_applies_it_and_repairs_both():
    call_in_release(MASKED, check_masked_release_needs_both_fixes)


def test_when_release_predates_the_engine_backward_rewrite_then_apply_is_a_noop():
    call_in_release(BEFORE_REWRITE, check_release_before_the_rewrite_is_a_noop_and_not_affected)
