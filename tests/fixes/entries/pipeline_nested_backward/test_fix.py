"""pipeline-nested-backward: the fix it requires applied first and reverted with it, a drifted instruction dispatch,
and 0.18.3 (the first affected release; the notebook runs 0.18.4) against plain PyTorch on two gloo ranks."""
import fixes
from fixes import harness
from tests.helpers import assert_drift_refused, call_in_release, pipeline_engine_classes

AFFECTED = "0.18.4"
FIX_ID = "pipeline-nested-backward"
REQUIRED_ID = "pipeline-stages-divide-by-gas-twice"


def check_apply_applies_the_required_fix_first_and_revert_reverts_it():
    engine = pipeline_engine_classes()[1]
    required = fixes.get(REQUIRED_ID)
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied" and f"also applied {REQUIRED_ID}" in outcome.message, outcome
    assert required.applied and "_backward_prologue_per_tensor" in vars(engine)
    fixes.revert(FIX_ID)
    assert not required.applied and required.probe().affected and "_backward_prologue_per_tensor" not in vars(engine)


def check_drifted_instruction_dispatch_raises_and_patches_nothing():
    """A drift the contract's check cannot make: the method is the known one, but train_batch no longer dispatches
    BackwardPass to it."""
    from deepspeed.runtime.pipe import schedule

    engine = pipeline_engine_classes()[1]
    engine._INSTRUCTION_MAP = {**engine._INSTRUCTION_MAP, schedule.BackwardPass: lambda self, buffer_id: None}
    assert_drift_refused(FIX_ID, engine, says="_INSTRUCTION_MAP[BackwardPass]")


def check_first_affected_release_trains_like_plain_pytorch_with_the_fix():
    from fixes.entries.pipeline_nested_backward import reproduce as repro

    pipeline_engine_classes()
    job = repro.PipeJob(micro_batches=2, fixes=(FIX_ID,))
    [params] = repro.run_pipelines([job], timeout=240)
    harness.assert_close(params, repro.train_sequential(job).params, job.dtype, f"fixed {job.label}")


def test_when_applied_then_the_required_fix_is_applied_first_and_reverted_with_it():
    call_in_release(AFFECTED, check_apply_applies_the_required_fix_first_and_revert_reverts_it)


def test_when_instruction_dispatch_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_instruction_dispatch_raises_and_patches_nothing)


def test_when_applied_on_first_affected_release_then_pipeline_matches_plain_pytorch():
    call_in_release("0.18.3", check_first_affected_release_trains_like_plain_pytorch_with_the_fix)
