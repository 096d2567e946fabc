"""zero3-reload-states-wrong-order beyond the contract and the notebook (0.16.0, fp32/bf16 and three offload options vs
plain PyTorch): which partitions the weight-decay split makes the bug swap, and the order the fix maps them in."""
from tests.helpers import call_in_release


def check_the_weight_decay_split_moves_two_partitions_and_the_fix_maps_in_buffer_order():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_reload_states_wrong_order.offload import job, partitions_after_reload

    harness.setup()
    [broken] = harness.launch(partitions_after_reload, 1, job())
    assert {row["parameter"] for row in broken if not row["holds its own values"]} == {"fc1.bias", "fc2.weight"}, broken
    fixes.apply("zero3-reload-states-wrong-order")
    [fixed] = harness.launch(partitions_after_reload, 1, job())
    assert [row["parameter"] for row in fixed] == ["fc1.weight", "fc2.weight", "fc1.bias", "fc2.bias"], fixed


def test_when_reloaded_then_the_split_parameters_are_swapped_until_the_fix_maps_in_buffer_order():
    call_in_release("0.16.0", check_the_weight_decay_split_moves_two_partitions_and_the_fix_maps_in_buffer_order)
