"""zero12-cpu-no-allreduce-noncontiguous on a real affected release (0.18.2), on 0.18.9 (where the flat-buffer fix it
requires is needed too) and on the newest (fixed) one, in child processes."""
from tests.helpers import call_in_release

AFFECTED = "0.18.2"
AFFECTED_WITH_FLAT_BUFFER_BUG = "0.18.9"
FIX_ID = "zero12-cpu-no-allreduce-noncontiguous"


def _module():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero import stage_1_and_2

    return stage_1_and_2


def check_cpu_gradients_fall_into_no_bucket_until_fixed():
    import torch

    import fixes

    module = _module()
    grads = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(4)]
    assert module.split_half_float_double(grads) == []  # the bug: every CPU gradient is dropped
    fixes.apply(FIX_ID)
    buckets = module.split_half_float_double(grads + [torch.ones(2).to_sparse()])
    assert [[tuple(t.shape) for t in bucket] for bucket in buckets] == [[(3,), (4,)], [(2,)]]  # float, then bf16; no sparse
    fixes.revert(FIX_ID)
    assert module.split_half_float_double(grads) == []


def check_zero2_bf16_two_ranks_match_plain_data_parallel_with_the_fix():
    from fixes.entries.zero12_cpu_no_allreduce_noncontiguous import reproduce as repro

    _module()
    job = repro.noncontiguous_job(stage=2, dtype="bfloat16")
    broken, _ = repro.two_ranks_versus_reference(job)
    assert not broken.close, broken
    fixed, ranks_agree = repro.two_ranks_versus_reference(job.with_(fixes=(*job.fixes, FIX_ID)))
    assert fixed.close and ranks_agree.close and ranks_agree.max_abs_diff == 0, (fixed, ranks_agree)


def check_fix_applies_the_flat_buffer_fix_it_requires():
    import fixes

    _module()
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and "also applied zero12-flat-buffer-detach" in outcome.message, outcome
    assert fixes.get("zero12-flat-buffer-detach").applied
    fixes.revert(FIX_ID)
    assert not fixes.get("zero12-flat-buffer-detach").applied


def check_non_cpu_accelerator_is_a_noop():
    import fixes

    module = _module()
    accelerator = module.get_accelerator()
    accelerator.device_name = lambda device_index=None: "cuda"  # as the CUDA accelerator names its tensors
    before = dict(vars(module))
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "what cuda tensors report" in outcome.message, outcome
    assert all(vars(module)[name] is value for name, value in before.items())


def test_when_gradients_are_on_cpu_then_only_the_fix_puts_them_in_dtype_buckets():
    call_in_release(AFFECTED, check_cpu_gradients_fall_into_no_bucket_until_fixed)


def test_when_zero2_bf16_two_ranks_train_with_the_fix_then_they_match_plain_data_parallel():
    call_in_release(AFFECTED, check_zero2_bf16_two_ranks_match_plain_data_parallel_with_the_fix)


def test_when_the_flat_buffer_bug_is_installed_too_then_apply_fixes_both_and_revert_undoes_both():
    call_in_release(AFFECTED_WITH_FLAT_BUFFER_BUG, check_fix_applies_the_flat_buffer_fix_it_requires)


def test_when_accelerator_is_not_cpu_then_apply_is_a_noop():
    call_in_release(AFFECTED, check_non_cpu_accelerator_is_a_noop)
