"""pipeline-grad-accum-sums on an affected release (0.18.2, the scaling condition in _backward_prologue), the
first affected one (0.16.0, the condition in backward itself), the first release of pipeline-nested-backward
(0.18.4: the two fixes together) and the newest (fixed) one. Each pipeline check runs a 2-stage PipelineModule
on 2 gloo ranks with gradient_accumulation_steps=4, in a release's child process."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_noop_on_fixed_release,
                           assert_drift_refused, assert_same_objects, call_in_release, pipeline_engine_classes,
                           snapshot)

AFFECTED = "0.18.2"
FIRST_AFFECTED = "0.16.0"
NESTED_AFFECTED = "0.18.4"  # pipeline-nested-backward's reproduce release
FIX_ID = "pipeline-grad-accum-sums"
NESTED_ID = "pipeline-nested-backward"
GAS = 4


def check_protocol_on_affected_release():
    engine, _ = pipeline_engine_classes()
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, engine)


def _pipeline_matches_plain_pytorch_when_fixed(jobs):
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_grad_accum_sums import reproduce as repro
    from fixes.harness.pipeline import run_pipelines, train_sequential

    assert fixes.get(FIX_ID).reproduce() is True, "the unfixed pipeline did not sum the micro-batches"
    fixed = [job.with_(fixes=(FIX_ID,)) for job in jobs]
    for job, params in zip(fixed, run_pipelines(fixed, timeout=240)):
        harness.assert_close(params, train_sequential(job).params, job.dtype, f"fixed {job.label}")
    # Each rank applies the fix and reverts it before training: the micro-batches are summed again.
    reverted = jobs[0].with_(fixes=(FIX_ID,), reverted=True, steps=1)
    rows = repro.measure([reverted])
    assert all(abs(row.ratio - GAS) < 1e-3 * GAS for row in rows), [row.row() for row in rows]


def check_fix_makes_the_pipeline_average_and_revert_brings_the_sum_back():
    from fixes.harness.pipeline import PipeJob

    pipeline_engine_classes()
    _pipeline_matches_plain_pytorch_when_fixed(
        [PipeJob(micro_batches=GAS, zero_stage=zero, dtype=dtype) for dtype, zero in
         (("float32", 0), ("float32", 1), ("bfloat16", 1))])


def check_unfixed_stages_are_gas_times_plain_pytorch_and_fixed_ones_equal():
    import fixes
    from fixes.entries.pipeline_grad_accum_sums import reproduce as repro

    pipeline_engine_classes()
    job = repro.PipeJob(steps=1, micro_batches=GAS)
    unfixed = repro.measure([job])
    assert [round(row.ratio, 4) for row in unfixed] == [GAS, GAS], [row.row() for row in unfixed]
    fixes.apply(FIX_ID)  # in this process: launch() applies it in the ranks
    try:
        fixed = repro.measure([job])
    finally:
        fixes.revert(FIX_ID)
    assert [round(row.ratio, 4) for row in fixed] == [1, 1], [row.row() for row in fixed]


def check_non_pipeline_engine_is_untouched():
    from fixes import harness

    pipeline_engine_classes()
    job = harness.Job(micro_steps=GAS, fixes=(FIX_ID,))  # ZeRO-0, fp32, one process: no pipeline
    harness.assert_close(harness.train_deepspeed(job).params, harness.train_reference(job).params, job.dtype,
                         "plain engine, fix applied")


def check_first_affected_release_is_fixed_too():
    from fixes.harness.pipeline import PipeJob

    check_protocol_on_affected_release()
    _pipeline_matches_plain_pytorch_when_fixed([PipeJob(micro_batches=GAS, zero_stage=0)])


def check_drifted_backward_raises_and_patches_nothing():
    engine, _ = pipeline_engine_classes()
    original = engine.backward

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True, sync=True):  # a new signature, the bug kept
        return original(self, loss, retain_graph=retain_graph, scale_wrt_gas=scale_wrt_gas)

    assert_drift_refused(FIX_ID, engine, "backward", backward)


def check_drifted_scaling_condition_raises_and_patches_nothing():
    import fixes

    engine, _ = pipeline_engine_classes()

    def _backward_prologue(self, loss, scale_wrt_gas=True):  # the condition written another way, the bug kept
        if self.enable_backward_allreduce and scale_wrt_gas and self.gradient_accumulation_steps() > 1:
            loss = self._scale_loss_by_gas(loss.float())
        return loss

    engine._backward_prologue = _backward_prologue
    assert fixes.get(FIX_ID).probe().affected
    before = snapshot(engine)
    try:
        fixes.apply(FIX_ID)
    except fixes.DriftError as exc:
        assert "DeepSpeedEngine._backward_prologue: the 1/gas scaling is not" in str(exc), exc
    else:
        raise AssertionError("a changed scaling condition was patched")
    assert_same_objects(engine, before)
    assert not fixes.get(FIX_ID).applied


def check_both_pipeline_fixes_apply_together():
    """Both fixes applied (on each release one of them is needed, the other a no-op), the pipeline
    matches plain PyTorch in fp32 with ZeRO-0 and ZeRO-1, and reverting both restores every object."""
    import fixes
    from fixes import harness
    from fixes.harness.pipeline import PipeJob, run_pipelines, train_sequential

    engine, pipe = pipeline_engine_classes()
    before = snapshot(engine), snapshot(pipe)
    outcomes = {outcome.fix_id: outcome.action for outcome in fixes.apply(FIX_ID, NESTED_ID)}
    assert sorted(outcomes.values()) == ["applied", "not needed"], outcomes
    try:
        jobs = [PipeJob(micro_batches=GAS, zero_stage=zero) for zero in (0, 1)]
        for job, params in zip(jobs, run_pipelines(jobs, timeout=240)):
            harness.assert_close(params, train_sequential(job).params, job.dtype, f"both fixes, {job.label}")
    finally:
        fixes.revert(FIX_ID, NESTED_ID)
    assert_same_objects(engine, before[0])
    assert_same_objects(pipe, before[1])


def check_fixed_release_is_a_noop_and_trains_like_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.harness.pipeline import PipeJob, run_pipelines, train_sequential

    engine, _ = pipeline_engine_classes()
    assert_noop_on_fixed_release(FIX_ID, engine)
    assert fixes.get(FIX_ID).reproduce() is False
    job = PipeJob(micro_batches=GAS)
    [params] = run_pipelines([job], timeout=240)
    harness.assert_close(params, train_sequential(job).params, job.dtype, f"unfixed {job.label}")


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_pipeline_matches_plain_pytorch_and_revert_brings_the_sum_back():
    call_in_release(AFFECTED, check_fix_makes_the_pipeline_average_and_revert_brings_the_sum_back, timeout=600)


def test_when_unfixed_then_each_stage_update_is_gas_times_plain_pytorch():
    call_in_release(AFFECTED, check_unfixed_stages_are_gas_times_plain_pytorch_and_fixed_ones_equal, timeout=600)


def test_when_engine_is_not_a_pipeline_then_fix_changes_nothing():
    call_in_release(AFFECTED, check_non_pipeline_engine_is_untouched)


def test_when_applied_on_first_affected_release_then_pipeline_matches_plain_pytorch():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_is_fixed_too, timeout=600)


def test_when_backward_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_backward_raises_and_patches_nothing)


def test_when_scaling_condition_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_scaling_condition_raises_and_patches_nothing)


def test_when_applied_with_pipeline_nested_backward_then_both_work_on_this_entrys_release():
    call_in_release(AFFECTED, check_both_pipeline_fixes_apply_together, timeout=600)


def test_when_applied_with_pipeline_nested_backward_then_both_work_on_its_release():
    call_in_release(NESTED_AFFECTED, check_both_pipeline_fixes_apply_together, timeout=600)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop_and_trains_like_plain_pytorch, timeout=600)
