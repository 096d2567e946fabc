"""zero3-stale-trace-after-hook-reregistration in child processes: on its reproduce release (0.19.0), on 0.19.1 (the
last affected), on 0.16.0 (the registration method still named ``_register_hooks_recursively``) and on the newest
(fixed upstream). ZeRO-3 on two ranks, CPU (gloo)."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.19.0"
FIX_ID = "zero3-stale-trace-after-hook-reregistration"


def _classes():
    """``DeepSpeedZeRoOffload`` and ``PartitionedParameterCoordinator``: the owners of the fix's targets."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    return DeepSpeedZeRoOffload, PartitionedParameterCoordinator


def check_protocol_on_affected_release():
    offload, coordinator = _classes()
    before = snapshot(coordinator)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, offload)
    assert_same_objects(coordinator, before)


def check_patched_methods_keep_the_installed_code_underneath():
    import inspect

    import fixes

    offload, coordinator = _classes()
    register, clear = vars(offload)["_register_deepspeed_module"], vars(coordinator)["_clear_trace_structures"]
    fixes.apply(FIX_ID)
    try:
        assert vars(offload)["_register_deepspeed_module"].__wrapped__ is register
        assert vars(coordinator)["_clear_trace_structures"].__wrapped__ is clear
        assert inspect.signature(vars(offload)["_register_deepspeed_module"]) == inspect.signature(register)
    finally:
        fixes.revert(FIX_ID)
    assert vars(offload)["_register_deepspeed_module"] is register


def check_the_crash_and_the_trace_it_comes_from():
    """The exact error, from record_parameters, in the second training step; and what the coordinator holds on the
    way: the trace in RECORD mode after the first step, the fetch steps kept under ids the modules no longer have
    once the hooks are registered again (the outer module gets the id the last module had)."""
    from fixes import harness
    from fixes.entries.zero3_stale_trace_after_hook_reregistration import generation as g

    _classes()
    outcome = g.run(g.job())
    assert outcome.bug_error, outcome.error_line
    assert outcome.error_line == "IndexError: pop from an empty deque"
    [facts, _] = harness.launch(g.trace_facts, g.WORLD_SIZE, g.job())
    first, trained, regenerated = facts["states"][0], facts["states"][-2], facts["states"][-1]
    assert list(first["ds_id per module"].values()) == list(range(len(first["ds_id per module"]))), first
    ids = list(trained["ds_id per module"].values())  # after the first generation registered the hooks once again
    assert trained["trace"] == regenerated["trace"] == "RECORD", facts
    assert trained["fetch steps recorded for ds_ids"] == regenerated["fetch steps recorded for ds_ids"]
    assert set(trained["fetch steps recorded for ds_ids"]) == set(ids), trained
    # every registration counts on from where the last one stopped: the outer module gets the last module's id
    assert list(regenerated["ds_id per module"].values()) == [i + ids[-1] - ids[0] for i in ids], regenerated


def check_with_the_fix_every_dtype_trains_and_generates_as_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_stale_trace_after_hook_reregistration import generation as g

    _classes()
    fixes.apply(FIX_ID)
    try:
        [facts, _] = harness.launch(g.trace_facts, g.WORLD_SIZE, g.job())
        assert [s["trace"] for s in facts["states"]] == ["INVALID", "INVALID", "RECORD", "INVALID"], facts
        assert not facts["states"][-1]["fetch steps recorded for ds_ids"], facts
        for dtype in ("float32", "bfloat16", "float16"):
            outcome = g.run(g.job(dtype))
            assert outcome.error is None, outcome.error_line
            for name, actual, expected in outcome.pairs():
                harness.assert_close(actual, expected, dtype, name)
        one_rank = g.run(g.job(), world_size=1)
        assert one_rank.trains_like_pytorch(), one_rank.comparisons()
    finally:
        fixes.revert(FIX_ID)


def check_the_reference_is_the_harness_reference():
    """``plain_reference``'s losses and weights are ``harness.train_reference``'s, bit for bit (the generation in
    between changes no weight): the model inside ``PolicyModel`` is TinyMLP, trained the same way, its gradients
    averaged in fp32 for fp32 and in the model's dtype otherwise (``grad_dtype``)."""
    import numpy as np

    from fixes import harness
    from fixes.entries.zero3_stale_trace_after_hook_reregistration import generation as g

    _classes()
    for dtype in ("float32", "bfloat16", "float16"):
        job = g.job(dtype)
        ours = g.plain_reference(job)
        grad_dtype = None if dtype == "float32" else harness.dtype_of(dtype)
        theirs = harness.train_reference(job, world_size=g.WORLD_SIZE, grad_dtype=grad_dtype)
        assert np.array_equal(ours.losses.T.reshape(-1), np.array(theirs.losses)), dtype
        assert {f"base_model.{k}": v for k, v in theirs.params.items()}.keys() == ours.params.keys()
        assert all(np.array_equal(ours.params[f"base_model.{k}"], v) for k, v in theirs.params.items()), dtype
        assert ours.completions.shape == (g.WORLD_SIZE, job.steps, job.micro_batch, g.NEW_TOKENS, 4)


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    def _register_deepspeed_module(self, module, count=[0]):
        module.ds_id = count[0]  # drifted: registers no hook at all

    offload, coordinator = _classes()
    before = snapshot(coordinator)
    assert_drift_refused(FIX_ID, offload, "_register_deepspeed_module", _register_deepspeed_module)
    assert_same_objects(coordinator, before)
    assert not fixes.get("zero3-gathered-params-cpu-race").applied  # nothing applied on its behalf either


def check_fixed_release_is_a_noop():
    import fixes

    offload, coordinator = _classes()
    before = snapshot(coordinator)
    assert_noop_on_fixed_release(FIX_ID, offload)
    assert_same_objects(coordinator, before)
    assert "invalidates the coordinator's trace" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_the_installed_methods_run_under_the_wrappers():
    call_in_release(AFFECTED, check_patched_methods_keep_the_installed_code_underneath)


def test_when_hooks_are_registered_again_then_the_next_step_pops_an_empty_deque():
    call_in_release(AFFECTED, check_the_crash_and_the_trace_it_comes_from)


def test_when_applied_then_every_dtype_matches_plain_pytorch():
    call_in_release(AFFECTED, check_with_the_fix_every_dtype_trains_and_generates_as_plain_pytorch, timeout=600)


def test_when_the_reference_is_computed_then_it_is_the_harness_reference():
    call_in_release(AFFECTED, check_the_reference_is_the_harness_reference)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
