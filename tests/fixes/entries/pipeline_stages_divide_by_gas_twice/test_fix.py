"""pipeline-stages-divide-by-gas-twice, each check a 2-stage PipelineModule on 2 gloo ranks (gas 4) in a release's
child process: ranks that apply and revert the fix, and 0.18.4, where ZeRO-0 also needs pipeline-nested-backward."""
from tests.helpers import assert_same_objects, call_in_release, pipeline_engine_classes, snapshot

AFFECTED = "0.18.9"
NESTED_AFFECTED = "0.18.4"  # pipeline-nested-backward's reproduce release: its refusal stops ZeRO-0 there
FIX_ID = "pipeline-stages-divide-by-gas-twice"
NESTED_ID = "pipeline-nested-backward"


def check_ranks_that_revert_the_fix_before_training_divide_stage0_twice_again():
    from fixes.entries.pipeline_stages_divide_by_gas_twice import reproduce as repro

    pipeline_engine_classes()
    reverted = repro.measure([repro.PipeJob(steps=1, micro_batches=4, zero_stage=1, fixes=(FIX_ID,), reverted=True)])
    assert repro.verdict(reverted) is True, [row.row() for row in reverted]


def check_zero0_on_nested_release_is_fixed_through_the_nested_fix():
    """pipeline-nested-backward's apply() applies this fix first, and its revert() reverts it."""
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_stages_divide_by_gas_twice import reproduce as repro

    _, pipe = pipeline_engine_classes()
    before = snapshot(pipe)
    [outcome] = fixes.apply(NESTED_ID)
    assert outcome.action == "applied" and FIX_ID in outcome.message, outcome
    assert fixes.get(FIX_ID).applied and not fixes.get(FIX_ID).probe().affected
    try:
        job = repro.PipeJob(steps=2, micro_batches=4, zero_stage=0)
        [params] = repro.run_pipelines([job], timeout=240)  # the ranks apply what this process applied
        harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"both fixes, {job.label}")
    finally:
        fixes.revert(NESTED_ID)
    assert not fixes.get(FIX_ID).applied and fixes.get(FIX_ID).probe().affected
    assert_same_objects(pipe, before)


def test_when_the_ranks_revert_the_fix_before_training_then_stage0_is_divided_twice_again():
    call_in_release(AFFECTED, check_ranks_that_revert_the_fix_before_training_divide_stage0_twice_again, timeout=600)


def test_when_nested_backward_release_then_zero0_is_fixed_through_its_fix():
    call_in_release(NESTED_AFFECTED, check_zero0_on_nested_release_is_fixed_through_the_nested_fix, timeout=600)
