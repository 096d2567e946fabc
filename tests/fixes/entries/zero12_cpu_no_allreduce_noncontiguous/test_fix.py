"""zero12-cpu-no-allreduce-noncontiguous: the dtype buckets themselves, ranks bit-identical (the notebook: within
fp32's tolerance), the flat-buffer fix it requires on 0.18.9, and a non-CPU accelerator left alone."""
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.18.2"
FIX_ID = "zero12-cpu-no-allreduce-noncontiguous"


def _module():
    harness.setup()
    from deepspeed.runtime.zero import stage_1_and_2

    return stage_1_and_2


def check_cpu_gradients_go_to_dtype_buckets_and_ranks_agree_exactly():
    from fixes.entries.zero12_cpu_no_allreduce_noncontiguous import reproduce as repro

    module = _module()
    grads = [torch.ones(3), torch.ones(2, dtype=torch.bfloat16), torch.ones(4), torch.ones(2).to_sparse()]
    assert module.split_half_float_double(grads) == []  # the bug: every CPU gradient is dropped
    fixes.apply(FIX_ID)
    try:  # float, then bf16; no sparse
        assert [[tuple(t.shape) for t in b] for b in module.split_half_float_double(grads)] == [[(3,), (4,)], [(2,)]]
    finally:
        fixes.revert(FIX_ID)
    job = repro.noncontiguous_job(stage=2, dtype="bfloat16")
    fixed, ranks_agree = repro.two_ranks_versus_reference(job.with_(fixes=(*job.fixes, FIX_ID)))
    assert fixed.close and ranks_agree.close and ranks_agree.max_abs_diff == 0, (fixed, ranks_agree)


def check_fix_applies_the_flat_buffer_fix_it_requires():
    _module()
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and "also applied zero12-flat-buffer-detach" in outcome.message, outcome
    assert fixes.get("zero12-flat-buffer-detach").applied
    fixes.revert(FIX_ID)
    assert not fixes.get("zero12-flat-buffer-detach").applied


def check_non_cpu_accelerator_is_a_noop():
    module = _module()
    module.get_accelerator().device_name = lambda device_index=None: "cuda"  # as the CUDA accelerator names tensors
    before = dict(vars(module))
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "what cuda tensors report" in outcome.message, outcome
    assert all(vars(module)[name] is value for name, value in before.items())


def test_when_gradients_are_on_cpu_then_the_fix_buckets_them_and_two_ranks_agree_bit_for_bit():
    call_in_release(AFFECTED, check_cpu_gradients_go_to_dtype_buckets_and_ranks_agree_exactly)


def test_when_the_flat_buffer_bug_is_installed_too_then_apply_fixes_both_and_revert_undoes_both():
    call_in_release("0.18.9", check_fix_applies_the_flat_buffer_fix_it_requires)


def test_when_accelerator_is_not_cpu_then_apply_is_a_noop():
    call_in_release(AFFECTED, check_non_cpu_accelerator_is_a_noop)
