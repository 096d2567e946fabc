"""zero3-hpz-stale-secondary-after-load on its affected release (0.18.2), the first fixed one (0.18.3) and the
newest, in child processes; two ZeRO-3 hpZ ranks on CPU (gloo)."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_noop_on_fixed_release,
                           assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.18.2"
FIX_ID = "zero3-hpz-stale-secondary-after-load"


def _owners():
    """(Init, DeepSpeedZeroOptimizer_Stage3): the owners of the two targets."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.partition_parameters import Init
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return Init, DeepSpeedZeroOptimizer_Stage3


def check_protocol_on_affected_release():
    init, stage3 = _owners()
    before = snapshot(stage3)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, init)
    assert_same_objects(stage3, before)


def check_both_targets_patched_and_restored():
    import fixes

    init, stage3 = _owners()
    originals = vars(init)["_partition"], vars(stage3)["checkpoint_event_epilogue"]
    evidence = fixes.get(FIX_ID).probe().evidence
    assert "without has_been_updated" in evidence and "keeps the secondary copies" in evidence, evidence
    assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
    assert vars(init)["_partition"] is not originals[0]
    assert vars(stage3)["checkpoint_event_epilogue"] is not originals[1]
    assert vars(init)["_partition"].__wrapped__ is originals[0]
    assert [o.action for o in fixes.revert(FIX_ID)] == ["reverted"]
    assert (vars(init)["_partition"], vars(stage3)["checkpoint_event_epilogue"]) == originals


def check_each_load_reproduces_then_the_fix_matches_plain_pytorch():
    from fixes import harness
    from fixes.entries.zero3_hpz_stale_secondary_after_load.hpz import LOADS, hpz_job, run

    _owners()
    for load in LOADS:
        broken = run(hpz_job(), load)
        assert all(broken.stale), broken  # every parameter's secondary copy is stale on both ranks
        harness.assert_differs(broken.losses, broken.reference_losses, "float32", f"{load}: losses, no fix")
        harness.assert_differs(broken.params, broken.reference_params, "float32", f"{load}: weights, no fix")
        fixed = run(hpz_job(fixes=(FIX_ID, )), load)
        assert not any(fixed.stale), fixed
        harness.assert_close(fixed.losses, fixed.reference_losses, "float32", f"{load}: losses, fixed")
        harness.assert_close(fixed.params, fixed.reference_params, "float32", f"{load}: weights, fixed")


def check_fixed_release_is_a_noop():
    import fixes

    init, stage3 = _owners()
    before = snapshot(stage3)
    assert_noop_on_fixed_release(FIX_ID, init)
    assert_same_objects(stage3, before)
    assert "passes has_been_updated" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_both_targets_are_wrapped_and_revert_restores_them():
    call_in_release(AFFECTED, check_both_targets_patched_and_restored)


def test_when_weights_are_loaded_then_training_differs_and_with_the_fix_it_matches_plain_pytorch():
    call_in_release(AFFECTED, check_each_load_reproduces_then_the_fix_matches_plain_pytorch)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
