"""zero3-reload-states-wrong-order in child processes: on its reproduce release (0.16.0), on the last affected
release (0.16.4), and on the newest (fixed upstream). ZeRO-3 on one rank, CPU (gloo), DeepSpeed's AdamW."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.16.0"
FIX_ID = "zero3-reload-states-wrong-order"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.zero3_reload_states_wrong_order import _RELOAD

    return _RELOAD.owner_and_name()[0]


def check_partitions_hold_their_own_values_after_reload_only_with_the_fix():
    """Upstream's check (PR #7050's test_offload_states with weight-decay groups): every ``ds_tensor`` equal to
    itself before ``offload_states`` after ``reload_states``."""
    import fixes
    from fixes import harness
    from fixes.entries.zero3_reload_states_wrong_order.offload import job, partitions_after_reload

    _owner()
    [broken] = harness.launch(partitions_after_reload, 1, job())
    hit = {row["parameter"] for row in broken if not row["holds its own values"]}
    assert hit == {"fc1.bias", "fc2.weight"}, broken  # the parameters the weight-decay split moves
    fixes.apply(FIX_ID)
    try:
        [fixed] = harness.launch(partitions_after_reload, 1, job())
    finally:
        fixes.revert(FIX_ID)
    assert all(row["holds its own values"] for row in fixed), fixed
    assert all(row["offset after reload_states"] == row["offset in lp_param_buffer"] for row in fixed), fixed
    assert [row["parameter"] for row in fixed] == ["fc1.weight", "fc2.weight", "fc1.bias", "fc2.bias"], fixed


def check_fixed_loop_matches_plain_pytorch_in_every_dtype_and_offload_option():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_reload_states_wrong_order.offload import ONE_GROUP, SPLIT, job, run

    _owner()
    assert run(job(), ONE_GROUP).matches, "one parameter group is not hit by this bug"
    assert not run(job(), SPLIT, {"pin_memory": False}).matches, "the bug shows without pinned memory too"
    fixes.apply(FIX_ID)
    try:
        for dtype, offload in [("float32", {}), ("bfloat16", {}), ("float32", {"pin_memory": False}),
                               ("float32", {"non_blocking": True})]:
            outcome = run(job(dtype), SPLIT, offload)
            assert outcome.error is None, outcome.error_line
            assert outcome.optimizer == "FusedAdam", outcome.optimizer
            harness.assert_close(outcome.params, outcome.reference_params, dtype, f"{dtype} {offload}: weights")
            harness.assert_close(outcome.losses, outcome.reference_losses, dtype, f"{dtype} {offload}: losses")
    finally:
        fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    import fixes
    from fixes.entries.zero3_reload_states_wrong_order import _RELOAD

    owner, name = _RELOAD.owner_and_name()

    def reload_states(self, non_blocking: bool = False):
        """Still the mapping in the model's order, but the rest of the method is gone."""
        from deepspeed.runtime.zero.utils import get_mapping_to_flat_buffer

        for tensor, offset, tensor_numel in get_mapping_to_flat_buffer(
                [p.ds_tensor for p in self.module.parameters()]):
            tensor.data = self.lp_param_buffer.narrow(0, offset, tensor_numel)

    _owner()
    assert_drift_refused(FIX_ID, owner, name, reload_states)
    assert not fixes.get(FIX_ID).applied


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _owner())
    assert "does not map the partitions in self.module.parameters() order" in fixes.get(FIX_ID).probe().evidence
    assert fixes.get(FIX_ID).reproduce() is False


def test_when_reloaded_then_each_partition_holds_its_own_values_only_with_the_fix():
    call_in_release(AFFECTED, check_partitions_hold_their_own_values_after_reload_only_with_the_fix)


def test_when_applied_then_the_loop_matches_plain_pytorch_in_every_dtype_and_offload_option():
    call_in_release(AFFECTED, check_fixed_loop_matches_plain_pytorch_in_every_dtype_and_offload_option, timeout=600)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
