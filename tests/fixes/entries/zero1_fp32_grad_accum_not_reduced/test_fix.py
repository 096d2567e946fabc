"""zero1-fp32-grad-accum-not-reduced beyond the contract and the notebook (0.19.3, bf16 and fp16 on two ranks vs plain
data parallel): what the reduction is handed, and 0.18.9, where the flat-buffer fix it requires is needed too."""
from tests.helpers import call_in_release

FIX_ID = "zero1-fp32-grad-accum-not-reduced"


def _setup():
    import fixes
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return fixes, DeepSpeedZeroOptimizer


def check_the_reduction_gets_a_copy_until_fixed():
    from types import SimpleNamespace

    import torch

    fixes, owner = _setup()
    stage_1_mode_2 = SimpleNamespace(use_grad_accum_attribute=True, dtype=torch.bfloat16)
    param = SimpleNamespace(grad_accum=torch.ones(3), grad=None)
    handed = owner.get_gradient_for_reduction(stage_1_mode_2, param)
    assert handed is not param.grad_accum and handed.dtype == torch.bfloat16  # the bug: a bf16 copy is reduced
    fixes.apply(FIX_ID)
    assert owner.get_gradient_for_reduction(stage_1_mode_2, param) is param.grad_accum  # the accumulator itself
    same_dtype = SimpleNamespace(use_grad_accum_attribute=False, dtype=torch.float32)
    assert owner.get_gradient_for_reduction(same_dtype, SimpleNamespace(grad_accum=None, grad=param.grad_accum)) \
        is param.grad_accum  # without a separate accumulator: param.grad, as before


def check_fix_applies_the_flat_buffer_fix_it_requires():
    fixes, _ = _setup()
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and "also applied zero12-flat-buffer-detach" in outcome.message, outcome
    assert fixes.get("zero12-flat-buffer-detach").applied
    fixes.revert(FIX_ID)
    assert not fixes.get("zero12-flat-buffer-detach").applied


def test_when_grad_accum_is_fp32_then_only_the_fix_reduces_the_accumulator_itself():
    call_in_release("0.19.3", check_the_reduction_gets_a_copy_until_fixed)


def test_when_the_flat_buffer_bug_is_installed_too_then_apply_fixes_both_and_revert_undoes_both():
    call_in_release("0.18.9", check_fix_applies_the_flat_buffer_fix_it_requires)
