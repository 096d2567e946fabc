"""zero12-cpu-no-allreduce-noncontiguous on a real affected release (0.18.2), on 0.18.9 (where the flat-buffer fix it
requires is needed too) and on the newest (fixed) one, in child processes."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, call_in_release)

AFFECTED = "0.18.2"
AFFECTED_WITH_FLAT_BUFFER_BUG = "0.18.9"
FIX_ID = "zero12-cpu-no-allreduce-noncontiguous"


def _module():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero import stage_1_and_2

    return stage_1_and_2


def check_protocol_on_affected_release():
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, _module())


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


def check_reproduces_then_the_fix_repairs_it():
    import fixes
    from fixes.entries.zero12_cpu_no_allreduce_noncontiguous.reproduce import reproduce

    _module()
    assert reproduce() is True
    fixes.apply(FIX_ID)
    assert reproduce() is False
    fixes.revert(FIX_ID)


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


def check_drifted_target_raises_and_patches_nothing():
    module = _module()

    def split_half_float_double(tensors):  # still names buckets by type strings, with one more dtype
        device_type = module.get_accelerator().device_name()
        dtypes = ["torch.{}.FloatTensor".format(device_type), "torch.{}.ByteTensor".format(device_type)]
        return [[t for t in tensors if t.type() == dtype] for dtype in dtypes]

    assert_drift_refused(FIX_ID, module, "split_half_float_double", split_half_float_double)


def check_non_cpu_accelerator_is_a_noop():
    import fixes

    module = _module()
    accelerator = module.get_accelerator()
    accelerator.device_name = lambda device_index=None: "cuda"  # as the CUDA accelerator names its tensors
    before = dict(vars(module))
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "what cuda tensors report" in outcome.message, outcome
    assert all(vars(module)[name] is value for name, value in before.items())


def check_fixed_release_is_a_noop():
    assert_noop_on_fixed_release(FIX_ID, _module())


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_gradients_are_on_cpu_then_only_the_fix_puts_them_in_dtype_buckets():
    call_in_release(AFFECTED, check_cpu_gradients_fall_into_no_bucket_until_fixed)


def test_when_applied_then_the_reproduction_no_longer_shows_the_bug():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it)


def test_when_zero2_bf16_two_ranks_train_with_the_fix_then_they_match_plain_data_parallel():
    call_in_release(AFFECTED, check_zero2_bf16_two_ranks_match_plain_data_parallel_with_the_fix)


def test_when_the_flat_buffer_bug_is_installed_too_then_apply_fixes_both_and_revert_undoes_both():
    call_in_release(AFFECTED_WITH_FLAT_BUFFER_BUG, check_fix_applies_the_flat_buffer_fix_it_requires)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_accelerator_is_not_cpu_then_apply_is_a_noop():
    call_in_release(AFFECTED, check_non_cpu_accelerator_is_a_noop)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
