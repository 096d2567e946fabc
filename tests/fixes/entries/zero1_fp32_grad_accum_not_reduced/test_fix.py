"""zero1-fp32-grad-accum-not-reduced on its reproduce release (0.19.3), on the last affected one (0.19.7), on 0.18.9
(where the flat-buffer fix it requires is needed too) and on the newest (fixed) one, in child processes."""
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
AFFECTED_WITH_FLAT_BUFFER_BUG = "0.18.9"
FIX_ID = "zero1-fp32-grad-accum-not-reduced"


def _owner():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def check_the_reduction_gets_a_copy_until_fixed():
    from types import SimpleNamespace

    import torch

    import fixes

    owner = _owner()
    stage_1_mode_2 = SimpleNamespace(use_grad_accum_attribute=True, dtype=torch.bfloat16)
    param = SimpleNamespace(grad_accum=torch.ones(3), grad=None)
    handed = owner.get_gradient_for_reduction(stage_1_mode_2, param)
    assert handed is not param.grad_accum and handed.dtype == torch.bfloat16  # the bug: a bf16 copy is reduced
    fixes.apply(FIX_ID)
    assert owner.get_gradient_for_reduction(stage_1_mode_2, param) is param.grad_accum  # the accumulator itself
    same_dtype = SimpleNamespace(use_grad_accum_attribute=False, dtype=torch.float32)
    assert owner.get_gradient_for_reduction(same_dtype, SimpleNamespace(grad_accum=None, grad=param.grad_accum)) \
        is param.grad_accum  # without a separate accumulator: param.grad, as before
    fixes.revert(FIX_ID)
    assert owner.get_gradient_for_reduction(stage_1_mode_2, param) is not param.grad_accum


def check_fp16_with_accumulation_matches_plain_data_parallel_with_the_fix():
    from fixes import harness
    from fixes.entries.zero1_fp32_grad_accum_not_reduced import reproduce as repro

    _owner()
    job = repro.zero1_job(dtype="float16", offload=False, steps=1, micro_steps=4)
    expected = repro.flat(repro.reference_fp32_grads(job))
    ranks = repro.run_ranks(job)
    broken = repro.stepped_gradient(ranks)
    assert not harness.compare(broken, expected, "float16").close
    for rank, (start, stop) in enumerate(repro.partition_slices(ranks)):  # each partition: its own shard's gradient
        assert harness.compare(broken[start:stop], repro.flat(repro.local_fp32_grads(job, rank))[start:stop],
                               "float16").close
    fixed = repro.stepped_gradient(repro.run_ranks(job.with_(fixes=(*job.fixes, FIX_ID))))
    comparison = harness.compare(fixed, expected, "float16")
    assert comparison.close, comparison


def check_fix_applies_the_flat_buffer_fix_it_requires():
    import fixes

    _owner()
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and "also applied zero12-flat-buffer-detach" in outcome.message, outcome
    assert fixes.get("zero12-flat-buffer-detach").applied
    fixes.revert(FIX_ID)
    assert not fixes.get("zero12-flat-buffer-detach").applied


def test_when_grad_accum_is_fp32_then_only_the_fix_reduces_the_accumulator_itself():
    call_in_release(AFFECTED, check_the_reduction_gets_a_copy_until_fixed)


def test_when_fp16_accumulates_four_micro_batches_with_the_fix_then_it_matches_plain_data_parallel():
    call_in_release(AFFECTED, check_fp16_with_accumulation_matches_plain_data_parallel_with_the_fix)


def test_when_the_flat_buffer_bug_is_installed_too_then_apply_fixes_both_and_revert_undoes_both():
    call_in_release(AFFECTED_WITH_FLAT_BUFFER_BUG, check_fix_applies_the_flat_buffer_fix_it_requires)
