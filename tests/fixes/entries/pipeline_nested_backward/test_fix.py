"""pipeline-nested-backward on the affected releases (0.18.4 in the release set, 0.18.3 the first affected) and
on the newest (fixed) one. Each check runs a 2-stage PipelineModule on 2 gloo ranks, in a release's child process.
On both affected releases pipeline-stages-divide-by-gas-twice is installed too: this fix requires it, so applying
this one applies that one first, and reverting this one reverts it."""
from ci import releases
from tests.helpers import assert_apply_is_idempotent_and_revert_exact, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.4"
FIRST_AFFECTED = "0.18.3"
FIX_ID = "pipeline-nested-backward"
REQUIRED_ID = "pipeline-stages-divide-by-gas-twice"
REFUSAL = "Direct calls to tensor.backward() are not supported"


def _pipeline_engine():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return PipelineEngine


def check_protocol_on_affected_release():
    engine = _pipeline_engine()
    original = engine._INSTRUCTION_MAP
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, engine)  # _INSTRUCTION_MAP included, by identity
    assert engine._INSTRUCTION_MAP is original
    assert "_backward_prologue_per_tensor" not in vars(engine), "the required fix's override was not removed"


def check_apply_applies_the_required_fix_first_and_revert_reverts_it():
    import fixes

    engine = _pipeline_engine()
    required = fixes.get(REQUIRED_ID)
    assert required.probe().affected
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and f"also applied {REQUIRED_ID}" in outcome.message, outcome
    assert required.applied and "_backward_prologue_per_tensor" in vars(engine)
    fixes.revert(FIX_ID)
    assert not required.applied and required.probe().affected and "_backward_prologue_per_tensor" not in vars(engine)


def check_fix_makes_the_pipeline_train_like_plain_pytorch_and_revert_brings_the_refusal_back():
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_nested_backward import reproduce as repro
    from fixes.exceptions import RankFailedError

    _pipeline_engine()
    assert fixes.get(FIX_ID).reproduce() is True, "the unfixed pipeline did not show the refusal"
    jobs = [repro.PipeJob(zero_stage=zero, micro_batches=2, fixes=(FIX_ID,)) for zero in (0, 1)]
    for job, params in zip(jobs, repro.run_pipelines(jobs, timeout=240)):
        harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"fixed {job.label}")
    try:  # each rank applies the fix and reverts it before training: the refusal is back
        repro.run_pipelines([jobs[0].with_(reverted=True)], timeout=240)
    except RankFailedError as exc:
        assert REFUSAL in exc.message, exc
    else:
        raise AssertionError("the pipeline trained after the fix was reverted")


def check_zero1_double_scaling_is_shown_unfixed_and_corrected_by_the_fix():
    """ZeRO-1 trains unfixed but, with several micro-batches, shows the required entry's double 1/gas
    scaling; this fix (with the one it requires) makes it plain PyTorch's."""
    from fixes import harness
    from fixes.entries.pipeline_nested_backward import reproduce as repro

    _pipeline_engine()
    job = repro.PipeJob(zero_stage=1, micro_batches=2)
    unfixed, fixed = repro.run_pipelines([job, job.with_(fixes=(FIX_ID,))], timeout=240)
    reference = repro.train_sequential(job).params
    harness.assert_differs(unfixed, reference, job.dtype, "unfixed ZeRO-1, 2 micro-batches")
    harness.assert_close(fixed, reference, job.dtype, "fixed ZeRO-1, 2 micro-batches")


def check_drifted_instruction_dispatch_raises_and_patches_nothing():
    import fixes
    from deepspeed.runtime.pipe import schedule

    engine = _pipeline_engine()
    # The method is the known one, but train_batch no longer dispatches BackwardPass to it.
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: lambda self, buffer_id: None}
    before = dict(vars(engine))
    try:
        fixes.apply(FIX_ID)
    except fixes.DriftError as exc:
        assert "_INSTRUCTION_MAP[BackwardPass]" in str(exc), exc
    else:
        raise AssertionError("a changed instruction dispatch was patched")
    assert all(vars(engine)[name] is value for name, value in before.items()) and vars(engine).keys() == before.keys()
    assert not fixes.get(FIX_ID).applied


def check_first_affected_release_is_fixed_too():
    from fixes import harness
    from fixes.entries.pipeline_nested_backward import reproduce as repro

    check_protocol_on_affected_release()
    job = repro.PipeJob(micro_batches=2, fixes=(FIX_ID,))
    [params] = repro.run_pipelines([job], timeout=240)
    harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"fixed {job.label}")


def check_fixed_release_is_a_noop_and_trains_like_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.pipeline_nested_backward import reproduce as repro

    assert_noop_on_fixed_release(FIX_ID, _pipeline_engine())
    assert fixes.get(FIX_ID).reproduce() is False
    job = repro.PipeJob(micro_batches=2)
    [params] = repro.run_pipelines([job], timeout=240)
    harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"unfixed {job.label}")


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_pipeline_trains_like_plain_pytorch_and_revert_restores_the_refusal():
    call_in_release(AFFECTED, check_fix_makes_the_pipeline_train_like_plain_pytorch_and_revert_brings_the_refusal_back)


def test_when_applied_then_the_required_fix_is_applied_first_and_reverted_with_it():
    call_in_release(AFFECTED, check_apply_applies_the_required_fix_first_and_revert_reverts_it)


def test_when_zero1_with_micro_batches_then_unfixed_differs_and_fixed_matches_plain_pytorch():
    call_in_release(AFFECTED, check_zero1_double_scaling_is_shown_unfixed_and_corrected_by_the_fix)


def test_when_instruction_dispatch_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_instruction_dispatch_raises_and_patches_nothing)


def test_when_applied_on_first_affected_release_then_pipeline_matches_plain_pytorch():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_is_fixed_too)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop_and_trains_like_plain_pytorch)
