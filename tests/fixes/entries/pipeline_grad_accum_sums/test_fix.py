"""pipeline-grad-accum-sums beyond the contract and the notebook (0.18.2, fp32/bf16, ZeRO 0/1 vs plain PyTorch): the
first affected release (0.16.0, the condition in backward itself), a second drift shape, the engine it must leave
alone, and together with pipeline-nested-backward. A 2-stage PipelineModule on 2 gloo ranks, gas=4."""
import pytest

from tests.helpers import assert_same_objects, call_in_release, pipeline_engine_classes, snapshot

AFFECTED = "0.18.2"
FIX_ID = "pipeline-grad-accum-sums"
NESTED_ID = "pipeline-nested-backward"
GAS = 4


def _pipelines_match_plain_pytorch(jobs, label):
    from fixes import harness
    from fixes.harness.pipeline import run_pipelines, train_sequential

    for job, params in zip(jobs, run_pipelines(jobs, timeout=240)):
        harness.assert_close(params, train_sequential(job).params, job.dtype, f"{label}, {job.label}")


def check_first_affected_release_matches_plain_pytorch():
    from fixes.harness.pipeline import PipeJob

    pipeline_engine_classes()
    _pipelines_match_plain_pytorch([PipeJob(micro_batches=GAS, fixes=(FIX_ID,))], "fixed")


def check_non_pipeline_engine_is_untouched():
    from fixes import harness

    pipeline_engine_classes()
    job = harness.Job(micro_steps=GAS, fixes=(FIX_ID,))  # ZeRO-0, fp32, one process: no pipeline
    harness.assert_close(harness.train_deepspeed(job).params, harness.train_reference(job).params, job.dtype,
                         "plain engine, fix applied")


def check_drifted_scaling_condition_raises_and_patches_nothing():
    import pytest

    import fixes

    engine, _ = pipeline_engine_classes()

    def _backward_prologue(self, loss, scale_wrt_gas=True):  # the condition written another way, the bug kept
        if self.enable_backward_allreduce and scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = self._scale_loss_by_gas(loss.float())
        return loss

    # not a target: the fix reads this condition, so the contract's drift of each target does not reach it
    engine._backward_prologue = _backward_prologue
    assert fixes.get(FIX_ID).probe().affected
    before = snapshot(engine)
    with pytest.raises(fixes.DriftError, match="DeepSpeedEngine._backward_prologue: the 1/gas scaling is not"):
        fixes.apply(FIX_ID)
    assert_same_objects(engine, before)
    assert not fixes.get(FIX_ID).applied


def check_both_pipeline_fixes_apply_together():
    """Both fixes applied (one needed, the other a no-op on each release): the pipeline matches plain PyTorch and
    reverting both restores every object."""
    import fixes
    from fixes.harness.pipeline import PipeJob

    engine, pipe = pipeline_engine_classes()
    before = snapshot(engine), snapshot(pipe)
    outcomes = {outcome.fix_id: outcome.action for outcome in fixes.apply(FIX_ID, NESTED_ID)}
    assert sorted(outcomes.values()) == ["applied", "not needed"], outcomes
    _pipelines_match_plain_pytorch([PipeJob(micro_batches=GAS, zero_stage=zero) for zero in (0, 1)], "both fixes")
    fixes.revert(FIX_ID, NESTED_ID)
    assert_same_objects(engine, before[0])
    assert_same_objects(pipe, before[1])


def test_when_applied_on_first_affected_release_then_pipeline_matches_plain_pytorch():
    call_in_release("0.16.0", check_first_affected_release_matches_plain_pytorch, timeout=600)


def test_when_engine_is_not_a_pipeline_then_fix_changes_nothing():
    call_in_release(AFFECTED, check_non_pipeline_engine_is_untouched)


def test_when_scaling_condition_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_scaling_condition_raises_and_patches_nothing)


@pytest.mark.parametrize("release", [AFFECTED, "0.18.4"])  # this entry's reproduce release; pipeline-nested-backward's
def test_when_applied_with_pipeline_nested_backward_then_both_work(release):
    call_in_release(release, check_both_pipeline_fixes_apply_together, timeout=600)
