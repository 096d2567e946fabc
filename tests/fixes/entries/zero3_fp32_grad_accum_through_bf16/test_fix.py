"""zero3-fp32-grad-accum-through-bf16 on its reproduce release (0.19.0), the first affected release (0.16.0: its
reductions read ``self.communication_data_type`` and its gradient bucket is in the model dtype), the last affected
one (0.19.1), the first fixed one (0.19.2) and the newest, in child processes; two ZeRO-3 ranks on CPU (gloo)."""
from ci import releases
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.0"
FIX_ID = "zero3-fp32-grad-accum-through-bf16"
CONTIGUOUS = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads"
UNMASK = ("zero3-gathered-params-cpu-race",)
SCATTER = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"


def _stage3():
    """DeepSpeedZeroOptimizer_Stage3: the owner of both targets."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return DeepSpeedZeroOptimizer_Stage3


def check_both_targets_wrapped_and_restored():
    import fixes

    stage3 = _stage3()
    originals = vars(stage3)[CONTIGUOUS], vars(stage3)[SCATTER]
    evidence = fixes.get(FIX_ID).probe().evidence
    assert "__avg_scatter_contiguous_grads and __avg_scatter_grads cast" in evidence, evidence
    assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
    assert vars(stage3)[CONTIGUOUS].__wrapped__ is originals[0]
    assert vars(stage3)[SCATTER].__wrapped__ is originals[1]
    assert [o.action for o in fixes.revert(FIX_ID)] == ["reverted"]
    assert (vars(stage3)[CONTIGUOUS], vars(stage3)[SCATTER]) == originals


def check_fixed_gradients_are_fp32_data_parallel_ones():
    """With the fix, each path's first-step gradient is plain PyTorch's fp32 average within even the fp32
    tolerance, and the trained weights match plain PyTorch within the bf16 one; without it the gradient differs
    beyond bf16's. The ranks apply zero3-gathered-params-cpu-race's fix (:data:`UNMASK`): without it ZeRO-3's
    post-step gather of its persistent parameters races on CPU, and the weights read back vary from run to run."""
    from fixes import harness
    from fixes.entries.zero3_fp32_grad_accum_through_bf16 import reproduce as repro

    _stage3()
    for path in repro.PATHS:
        job = repro.zero3_job(path, fixes=UNMASK)
        expected = repro.reference_fp32_grads(job)
        reference = harness.train_reference(job, world_size=2)
        for rank in repro.run_ranks(job):
            harness.assert_differs(rank["fp32_grads"][0], expected, "bfloat16", f"{path}: gradient, no fix")
        for rank in repro.run_ranks(job.with_(fixes=(*UNMASK, FIX_ID))):
            harness.assert_close(rank["fp32_grads"][0], expected, "float32", f"{path}: gradient, fixed")
            harness.assert_close(rank["params"], reference.params, "bfloat16", f"{path}: trained weights, fixed")


def check_fix_changes_nothing_where_dtypes_agree():
    """Jobs this bug does not touch train bit for bit the same with the fix applied: bf16 communication (the
    default), bf16 gradient accumulation (the default), fp32 training."""
    import numpy as np

    from fixes.entries.zero3_fp32_grad_accum_through_bf16 import reproduce as repro

    _stage3()
    base = repro.zero3_job(steps=1)
    for label, job in {"bf16 communication": base.with_(config={"data_types": {"grad_accum_dtype": "fp32"}}),
                       "bf16 accumulation": base.with_(config={"communication_data_type": "fp32"}),
                       "fp32 training": base.with_(dtype="float32")}.items():
        as_is = repro.first_step_grads(job)
        fixed = repro.first_step_grads(job.with_(fixes=(FIX_ID,)))
        for got, want in zip(fixed, as_is):
            for name in want:
                assert np.array_equal(got[name], want[name]), f"{label}: {name} changed by the fix"


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _stage3())
    assert "gradient_accumulation_dtype, not to the model dtype" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_then_both_reductions_are_wrapped_and_revert_restores_them():
    call_in_release(AFFECTED, check_both_targets_wrapped_and_restored)


def test_when_applied_then_gradients_are_fp32_averages_and_weights_match_plain_pytorch():
    call_in_release(AFFECTED, check_fixed_gradients_are_fp32_data_parallel_ones)


def test_when_dtypes_need_no_cast_then_the_fix_changes_no_gradient():
    call_in_release(AFFECTED, check_fix_changes_nothing_where_dtypes_agree)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
