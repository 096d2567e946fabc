"""bf16-gets-fp16-optimizer on its reproduce release (0.18.4), on the first affected one (0.17.6, whose
engine.backward still goes through optimizer.backward), and on the newest (fixed) one."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.18.4"
FIRST_AFFECTED = "0.17.6"
FIX_ID = "bf16-gets-fp16-optimizer"


def _engine_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _optimizer_name(job):
    from fixes import harness

    return type(harness.build_engine(job).optimizer).__name__


def check_protocol_on_affected_release():
    import deepspeed.runtime.constants as constants
    import deepspeed.runtime.engine as engine_module
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    cls = _engine_class()
    before = snapshot(BF16_Optimizer), engine_module.DDP_BFLOAT16, constants.DDP_BFLOAT16
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, cls)  # probe/apply/revert cycle
    # The patches live on the modules and on BF16_Optimizer, not on the engine class: check them too.
    import fixes

    fixes.apply(FIX_ID)
    assert engine_module.DDP_BFLOAT16 == constants.DDP_BFLOAT16 == "ddp_bf16"
    assert vars(BF16_Optimizer)["custom_loss_scaler"] is False and "scale_if_loss" in vars(BF16_Optimizer)
    fixes.revert(FIX_ID)
    assert_same_objects(BF16_Optimizer, before[0])
    assert (engine_module.DDP_BFLOAT16, constants.DDP_BFLOAT16) == before[1:] == ("bf16", "bf16")


def check_fix_builds_bf16_optimizer_matching_plain_pytorch_and_revert_brings_the_bug_back():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_gets_fp16_optimizer.reproduce import bf16_fp32_accumulation_job

    _engine_class()
    sgd, adam = bf16_fp32_accumulation_job(), bf16_fp32_accumulation_job(optimizer="adam")
    assert _optimizer_name(sgd) == "FP16_UnfusedOptimizer"
    unfixed = harness.versus_reference("unfixed", adam)
    harness.assert_differs(unfixed.deepspeed.params, unfixed.reference.params, "bfloat16", "unfixed Adam")
    fixes.apply(FIX_ID)
    for zero_stage in (0, 1):
        for job in (sgd.with_(zero_stage=zero_stage), adam.with_(zero_stage=zero_stage)):
            assert _optimizer_name(job) == "BF16_Optimizer"
            run = harness.versus_reference(f"fixed ZeRO-{zero_stage} {job.optimizer}", job)
            harness.assert_close(run.deepspeed.params, run.reference.params, "bfloat16", run.params.name)
            harness.assert_close(run.deepspeed.grad_norms, run.reference.grad_norms, "bfloat16", run.grad_norms.name)
    fixes.revert(FIX_ID)
    assert _optimizer_name(sgd) == "FP16_UnfusedOptimizer"


def check_fix_leaves_bf16_without_fp32_accumulation_and_zero2_alone():
    import fixes
    from fixes.entries.bf16_gets_fp16_optimizer.reproduce import bf16_fp32_accumulation_job

    _engine_class()
    fixes.apply(FIX_ID)
    ddp = bf16_fp32_accumulation_job(zero_stage=0).with_(config={"fp16": {"enabled": False}})
    assert _optimizer_name(ddp) == "FP16_UnfusedOptimizer"  # the DDP_BFLOAT16 path, as designed
    assert _optimizer_name(bf16_fp32_accumulation_job(zero_stage=2)) == "DeepSpeedZeroOptimizer"
    fixes.revert(FIX_ID)


def check_first_affected_release_is_repaired_without_the_scaler_attributes():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_gets_fp16_optimizer.reproduce import bf16_fp32_accumulation_job
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    _engine_class()
    fix = fixes.get(FIX_ID)
    assert fix.probe().affected and fix.reproduce()
    fixes.apply(FIX_ID)
    assert "scale_if_loss" not in vars(BF16_Optimizer)  # engine.backward calls optimizer.backward here
    job = bf16_fp32_accumulation_job(optimizer="adam")
    assert _optimizer_name(job) == "BF16_Optimizer"
    run = harness.versus_reference("fixed", job)
    harness.assert_close(run.deepspeed.params, run.reference.params, "bfloat16", run.params.name)
    fixes.revert(FIX_ID)
    assert fix.reproduce()


def check_drifted_target_raises_and_patches_nothing():
    import deepspeed.runtime.engine as engine_module

    def _do_optimizer_sanity_check(self, basic_optimizer, new_argument=None):  # drifted, collision kept
        return engine_module.BFLOAT16

    assert_drift_refused(FIX_ID, _engine_class(), "_do_optimizer_sanity_check", _do_optimizer_sanity_check)
    assert engine_module.DDP_BFLOAT16 == "bf16"  # nothing patched


def check_fixed_release_is_a_noop():
    import fixes
    from fixes.entries.bf16_gets_fp16_optimizer.reproduce import bf16_fp32_accumulation_job

    assert_noop_on_fixed_release(FIX_ID, _engine_class())
    assert not fixes.get(FIX_ID).reproduce()
    assert _optimizer_name(bf16_fp32_accumulation_job()) == "BF16_Optimizer"


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_bf16_fp32_accumulation_gets_bf16_optimizer_and_matches_plain_pytorch():
    call_in_release(AFFECTED, check_fix_builds_bf16_optimizer_matching_plain_pytorch_and_revert_brings_the_bug_back)


def test_when_applied_then_bf16_without_fp32_accumulation_and_zero2_keep_their_optimizers():
    call_in_release(AFFECTED, check_fix_leaves_bf16_without_fp32_accumulation_and_zero2_alone)


def test_when_first_affected_release_then_fix_repairs_it():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_is_repaired_without_the_scaler_attributes)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
