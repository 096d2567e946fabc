"""elastic-batch-exceeds-max on its reproduce release, on the oldest swept release, on the first release upstream
fixed and on the newest (which has no elastic training), in child processes."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.3"
FIRST_FIXED = "0.19.6"  # upstream PR #8237
FIX_ID = "elastic-batch-exceeds-max"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.elastic_batch_exceeds_max import _CANDIDATES

    return _CANDIDATES.owner_and_name()[0]


def _batch(micro_batches, cap, world_size=0, version=0.1):
    """``compute_elastic_config`` as the engine calls it: (train batch size, valid GPU counts[, micro batch])."""
    import deepspeed
    from deepspeed.git_version_info import version as ds_version

    block = {"enabled": True, "max_train_batch_size": cap, "micro_batch_sizes": micro_batches, "min_gpus": 1,
             "max_gpus": 1500, "min_time": 20, "version": version}
    return deepspeed.elasticity.compute_elastic_config(ds_config={"elasticity": block},
                                                       target_deepspeed_version=ds_version, world_size=world_size)


def check_the_fixed_batch_is_within_the_cap_and_unchanged_where_the_lcm_fits():
    import itertools

    import fixes
    from fixes.entries.elastic_batch_exceeds_max import reproduce as elastic

    module = _owner()
    before = {"user": _batch([8, 10, 12], 100)[0], "small": _batch([8, 12], 16)[0],
              "upstream": _batch([1, 2, 3, 7], 32)[0], "docs": _batch([2, 4, 6], 2000)[0],
              "at cap": _batch([8, 12], 24)[0], "v0.2": _batch([8, 10, 12], 100, world_size=1, version=0.2)[0]}
    assert before == {"user": 120, "small": 24, "upstream": 42, "docs": 1680, "at cap": 24, "v0.2": 120}, before
    sets = [list(s) for size in (2, 3) for s in itertools.combinations(range(1, 13), size)]
    caps = range(1, 61)
    unfixed = {(tuple(s), cap): module._get_compatible_gpus_v01(s, cap)[0] for s in sets for cap in caps
               if max(s) <= cap}
    fixes.apply(FIX_ID)
    try:
        after = {"user": _batch([8, 10, 12], 100)[0], "small": _batch([8, 12], 16)[0],
                 "upstream": _batch([1, 2, 3, 7], 32)[0], "docs": _batch([2, 4, 6], 2000)[0],
                 "at cap": _batch([8, 12], 24)[0], "v0.2": _batch([8, 10, 12], 100, world_size=1, version=0.2)[0]}
        assert after == {"user": elastic.ALLOWED_BATCH, "small": 16, "upstream": 24, "docs": 1680, "at cap": 24,
                         "v0.2": elastic.ALLOWED_BATCH}, after
        # upstream's updated test_proper_mbsz: at world size 4 the batch per GPU is 6 and 3 is the micro batch
        assert _batch([1, 2, 3, 7], 32, world_size=4)[2] == 3
        for (micro, cap), old in unfixed.items():
            new = module._get_compatible_gpus_v01(list(micro), cap)[0]
            assert new <= cap, (micro, cap, new)
            if old <= cap:  # the LCM was within the cap, or lost the vote: the fix changes nothing
                assert new == old, (micro, cap, old, new)
        assert any(old > cap for (_, cap), old in unfixed.items())
        assert elastic.reproduce() is False
    finally:
        fixes.revert(FIX_ID)
    assert _batch([8, 10, 12], 100)[0] == 120


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.elastic_batch_exceeds_max import _CANDIDATES

    owner, name = _CANDIDATES.owner_and_name()

    def get_candidate_batch_sizes(base_list, max_acceptable_batch_size):
        """A drifted get_candidate_batch_sizes that still keeps a base above the cap (it scales by plain multiples)."""
        candidate_batch_size = []
        for base in base_list:
            if base >= max_acceptable_batch_size:
                candidate_batch_size.append(base)
            else:
                candidate_batch_size.append(base * (max_acceptable_batch_size // base))
        return sorted(set(candidate_batch_size))

    _owner()
    assert_drift_refused(FIX_ID, owner, name, get_candidate_batch_sizes)


def check_first_fixed_release_is_a_noop():
    from fixes.entries.elastic_batch_exceeds_max import reproduce as elastic

    assert_noop_on_fixed_release(FIX_ID, _owner())
    assert elastic.reproduce() is False
    assert _batch([8, 10, 12], 100)[0] == elastic.ALLOWED_BATCH


def check_release_without_elastic_training_is_a_noop():
    import importlib.util

    import pytest

    import fixes
    from fixes import harness
    from fixes.entries.elastic_batch_exceeds_max import reproduce as elastic

    harness.setup()
    assert importlib.util.find_spec("deepspeed.elasticity") is None
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "not affected" in outcome.message, outcome
    assert "deepspeed.elasticity does not exist" in outcome.message, outcome
    assert elastic.reproduce() is False
    with pytest.raises(Exception, match=elastic.REMOVED):
        elastic.engine_for(elastic.config())


def test_when_applied_then_every_batch_is_within_the_cap_and_configs_whose_lcm_fits_are_unchanged():
    call_in_release(AFFECTED, check_the_fixed_batch_is_within_the_cap_and_unchanged_where_the_lcm_fits)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(FIRST_FIXED, check_first_fixed_release_is_a_noop)


def test_when_release_has_no_elastic_training_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_release_without_elastic_training_is_a_noop)
