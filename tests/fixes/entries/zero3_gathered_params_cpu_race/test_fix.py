"""zero3-gathered-params-cpu-race on a real affected release (0.18.9) and on the newest (fixed) one,
and the wrapper's splitting rule on its own (no DeepSpeed)."""
import pytest

from ci import releases
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.9"
REWRITTEN = "0.19.7"  # Init._allgather_params_coalesced rewritten in 0.19.3 (per-parameter group sizes); still racy
FIX_ID = "zero3-gathered-params-cpu-race"


def _init_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.partition_parameters import Init

    return Init


def check_applies_and_reverts_exactly_on_rewritten_function():
    import fixes

    init = _init_class()
    original = vars(init)["_allgather_params_coalesced"]
    assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
    assert vars(init)["_allgather_params_coalesced"] is not original
    assert [o.action for o in fixes.revert(FIX_ID)] == ["reverted"]
    assert vars(init)["_allgather_params_coalesced"] is original


def check_race_shows_and_fix_matches_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_gathered_params_cpu_race.gathering import gather_job, run_gather_race

    _init_class()
    fix = fixes.get(FIX_ID)
    assert fix.reproduce() is True  # 400 gathers; measured 29 of 400 corrupt on this release
    job = gather_job(steps=100, fixes=(FIX_ID, ))
    runs = run_gather_race(job)
    reference = harness.train_reference(job, world_size=2)
    for run in runs:
        assert run.corrupt == 0, run
        harness.assert_close(run.params, reference.params, "float32", f"rank {run.rank} vs plain PyTorch")


def check_probe_sees_an_accelerator_that_orders_the_gathers():
    from deepspeed.accelerator import get_accelerator

    import fixes

    _init_class()
    fix = fixes.get(FIX_ID)
    accelerator = type(get_accelerator())
    assert fix.probe().affected
    original = accelerator.resolves_data_dependency
    accelerator.resolves_data_dependency = lambda self: False  # what CUDA answers: DeepSpeed synchronizes
    try:
        probe = fix.probe()
        assert not probe.affected and "orders all of them" in probe.evidence, probe
    finally:
        accelerator.resolves_data_dependency = original


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _init_class())
    assert "waits for every all-gather handle" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_on_release_with_rewritten_function_then_applied_and_revert_is_exact():
    call_in_release(REWRITTEN, check_applies_and_reverts_exactly_on_rewritten_function)


def test_when_two_ranks_gather_without_the_fix_then_values_differ_and_with_it_they_match_plain_pytorch():
    call_in_release(AFFECTED, check_race_shows_and_fix_matches_plain_pytorch)


def test_when_the_accelerator_synchronizes_then_the_probe_says_not_affected():
    call_in_release(AFFECTED, check_probe_sees_an_accelerator_that_orders_the_gathers)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)


@pytest.mark.parametrize(("skips_synchronize", "params", "calls"), [
    (True, ["a", "b", "c"], [["a"], ["b"], ["c"]]),  # CPU: one parameter per call, in DeepSpeed's order
    (True, ["a"], [["a"]]),
    (False, ["a", "b", "c"], [["a", "b", "c"]]),  # CUDA: the original, untouched
])
def test_when_several_parameters_are_gathered_then_the_wrapper_splits_them_only_where_needed(
        monkeypatch, skips_synchronize, params, calls):
    from fixes.entries import zero3_gathered_params_cpu_race as entry

    seen = []

    def original(self, param_list, hierarchy=0, quantize=False):
        seen.append((list(param_list), hierarchy, quantize))

    monkeypatch.setattr(entry, "_skips_synchronize", lambda: skips_synchronize)
    wrapped = entry._one_at_a_time(original)
    assert wrapped(object(), params, 3, quantize=True) is None
    assert seen == [(call, 3, True) for call in calls]
