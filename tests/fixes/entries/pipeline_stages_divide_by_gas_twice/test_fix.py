"""pipeline-stages-divide-by-gas-twice on its reproduce release (0.18.9), on pipeline-nested-backward's release
(0.18.4: ZeRO-1 alone shows it there; that entry's fix applies this one first) and on the newest (fixed) one.
Each pipeline check runs a 2-stage PipelineModule on 2 gloo ranks with gradient_accumulation_steps=4, in a
release's child process."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, assert_same_objects, call_in_release, pipeline_engine_classes,
                           snapshot)

AFFECTED = "0.18.9"
NESTED_AFFECTED = "0.18.4"  # pipeline-nested-backward's reproduce release: its refusal stops ZeRO-0 there
FIX_ID = "pipeline-stages-divide-by-gas-twice"
NESTED_ID = "pipeline-nested-backward"
GAS = 4


def check_protocol_on_affected_release():
    _, pipe = pipeline_engine_classes()
    assert "_backward_prologue_per_tensor" not in vars(pipe)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, pipe)
    assert "_backward_prologue_per_tensor" not in vars(pipe), "the added override was not removed"


def check_unfixed_stage0_is_a_quarter_and_the_fix_makes_both_stages_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_stages_divide_by_gas_twice import reproduce as repro

    pipeline_engine_classes()
    assert fixes.get(FIX_ID).reproduce() is True, "the unfixed pipeline did not divide stage 0 twice"
    jobs = [repro.PipeJob(steps=1, micro_batches=GAS, zero_stage=zero) for zero in (0, 1)]
    unfixed = repro.measure(jobs)
    assert [round(row.ratio, 4) for row in unfixed] == [1 / GAS, 1] * 2, [row.row() for row in unfixed]
    fixed_jobs = [job.with_(fixes=(FIX_ID,), steps=2) for job in jobs]  # each rank applies the fix
    for job, params in zip(fixed_jobs, repro.run_pipelines(fixed_jobs, timeout=240)):
        harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"fixed {job.label}")
    # Each rank applies the fix and reverts it before training: stage 0 is divided twice again.
    reverted = repro.measure([jobs[1].with_(fixes=(FIX_ID,), reverted=True)])
    assert repro.verdict(reverted) is True, [row.row() for row in reverted]


def check_bf16_is_divided_twice_and_fixed_too():
    from fixes.entries.pipeline_stages_divide_by_gas_twice import reproduce as repro

    pipeline_engine_classes()
    job = repro.PipeJob(steps=1, micro_batches=GAS, zero_stage=1, dtype="bfloat16")
    unfixed, fixed = repro.measure([job]), repro.measure([job.with_(fixes=(FIX_ID,))])
    assert abs(unfixed[0].ratio - 1 / GAS) < 0.2 / GAS and abs(unfixed[1].ratio - 1) < 0.2, \
        [row.row() for row in unfixed]  # bf16 rounds: near, not exactly (0.2735, 1.0114 on 0.18.9)
    assert all(abs(row.ratio - 1) < 0.1 for row in fixed), [row.row() for row in fixed]


def check_drifted_per_tensor_scaling_raises_and_patches_nothing():
    engine, pipe = pipeline_engine_classes()

    def _backward_prologue_per_tensor(self, grad):  # written another way, the bug kept
        return None if grad is None else grad * (1.0 / self.gradient_accumulation_steps())

    before = snapshot(pipe)
    assert_drift_refused(FIX_ID, engine, "_backward_prologue_per_tensor", _backward_prologue_per_tensor)
    assert_same_objects(pipe, before)


def check_zero1_on_nested_release_fixed_alone_and_zero0_through_the_nested_fix():
    """0.18.4: this fix alone repairs ZeRO-1; ZeRO-0 needs pipeline-nested-backward, whose apply()
    applies this fix first, and whose revert() reverts it."""
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_stages_divide_by_gas_twice import reproduce as repro

    _, pipe = pipeline_engine_classes()
    check_protocol_on_affected_release()
    assert fixes.get(FIX_ID).reproduce() is True
    fixes.apply(FIX_ID)
    try:
        assert fixes.get(FIX_ID).reproduce() is False
    finally:
        fixes.revert(FIX_ID)
    before = snapshot(pipe)
    [outcome] = fixes.apply(NESTED_ID)
    assert outcome.action == "applied" and FIX_ID in outcome.message, outcome
    assert fixes.get(FIX_ID).applied and not fixes.get(FIX_ID).probe().affected
    try:
        job = repro.PipeJob(steps=2, micro_batches=GAS, zero_stage=0)
        [params] = repro.run_pipelines([job], timeout=240)  # the ranks apply what this process applied
        harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"both fixes, {job.label}")
    finally:
        fixes.revert(NESTED_ID)
    assert not fixes.get(FIX_ID).applied and fixes.get(FIX_ID).probe().affected
    assert_same_objects(pipe, before)


def check_fixed_release_is_a_noop_and_trains_like_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_stages_divide_by_gas_twice import reproduce as repro

    _, pipe = pipeline_engine_classes()
    assert "_backward_prologue_per_tensor" in vars(pipe)  # PR #8154's own override
    assert_noop_on_fixed_release(FIX_ID, pipe)
    assert fixes.get(FIX_ID).reproduce() is False
    job = repro.PipeJob(steps=2, micro_batches=GAS)
    [params] = repro.run_pipelines([job], timeout=240)
    harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"unfixed {job.label}")


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_unfixed_then_stage0_is_divided_twice_and_fixed_matches_plain_pytorch():
    call_in_release(AFFECTED, check_unfixed_stage0_is_a_quarter_and_the_fix_makes_both_stages_plain_pytorch,
                    timeout=600)


def test_when_bf16_then_stage0_is_divided_twice_and_fixed():
    call_in_release(AFFECTED, check_bf16_is_divided_twice_and_fixed_too, timeout=600)


def test_when_per_tensor_scaling_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_per_tensor_scaling_raises_and_patches_nothing)


def test_when_nested_backward_release_then_zero1_fixed_alone_and_zero0_through_its_fix():
    call_in_release(NESTED_AFFECTED, check_zero1_on_nested_release_fixed_alone_and_zero0_through_the_nested_fix,
                    timeout=600)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop_and_trains_like_plain_pytorch, timeout=600)
