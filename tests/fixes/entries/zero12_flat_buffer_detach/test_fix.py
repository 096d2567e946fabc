"""zero12-flat-buffer-detach on a real affected release (0.18.9) and on the newest (fixed) one."""
from ci import releases
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.9"
FIX_ID = "zero12-flat-buffer-detach"


def _class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return DeepSpeedZeroOptimizer


def _flat_buffer_grad_fn(stage: int):
    from fixes import harness

    return harness.build_engine(harness.Job(zero_stage=stage)).optimizer.bit16_groups_flat[0].grad_fn


def check_fix_detaches_the_flat_buffer_for_stages_1_and_2():
    import fixes

    _class()
    assert type(_flat_buffer_grad_fn(2)).__name__ == "CatBackward0"
    fixes.apply(FIX_ID)
    assert _flat_buffer_grad_fn(1) is None and _flat_buffer_grad_fn(2) is None
    fixes.revert(FIX_ID)
    assert _flat_buffer_grad_fn(2) is not None


def check_fix_lets_two_ranks_train_like_plain_pytorch():
    from fixes import harness
    from fixes.exceptions import RankFailedError

    job = harness.Job(zero_stage=2)
    try:
        harness.launch(harness.run_job, 2, job, timeout=180)
    except RankFailedError as exc:
        assert "is a view and is being modified inplace" in exc.message, exc.message
    else:
        raise AssertionError("two ranks trained without the fix on an affected release")
    fixed = harness.launch(harness.run_job, 2, job.with_(fixes=(FIX_ID,)), timeout=180)
    harness.assert_close(fixed[0].params, harness.train_reference(job, world_size=2).params, "float32", "2 ranks")


def check_fixed_release_is_a_noop():
    assert_noop_on_fixed_release(FIX_ID, _class())
    assert _flat_buffer_grad_fn(2) is None  # upstream detaches it itself


def test_when_applied_then_flat_buffer_has_no_graph_and_revert_brings_it_back():
    call_in_release(AFFECTED, check_fix_detaches_the_flat_buffer_for_stages_1_and_2)


def test_when_two_ranks_train_with_the_fix_then_they_match_plain_data_parallel():
    call_in_release(AFFECTED, check_fix_lets_two_ranks_train_like_plain_pytorch)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
