"""elastic-batch-exceeds-max: on 0.19.3 every small config stays within its cap and those whose LCM fits are left
alone; on 0.19.6, upstream's fix (PR #8237) picks the batch this fix picks."""
import pytest

import fixes
from fixes import harness
from tests.helpers import call_in_release

FIX_ID = "elastic-batch-exceeds-max"
# (micro-batch sizes, max_train_batch_size[, world size, elasticity version]) -> unfixed, fixed train batch size
CASES = {"user": (([8, 10, 12], 100), 120, None), "small": (([8, 12], 16), 24, 16),
         "upstream": (([1, 2, 3, 7], 32), 42, 24), "docs": (([2, 4, 6], 2000), 1680, 1680),
         "at cap": (([8, 12], 24), 24, 24), "v0.2": (([8, 10, 12], 100, 1, 0.2), 120, None)}


def _batch(micro_batches, cap, world_size=0, version=0.1):
    """``compute_elastic_config`` as the engine calls it: (train batch size, valid GPU counts[, micro batch])."""
    import deepspeed
    from deepspeed.git_version_info import version as ds_version

    block = {"enabled": True, "max_train_batch_size": cap, "micro_batch_sizes": micro_batches, "min_gpus": 1,
             "max_gpus": 1500, "min_time": 20, "version": version}
    return deepspeed.elasticity.compute_elastic_config(ds_config={"elasticity": block},
                                                       target_deepspeed_version=ds_version, world_size=world_size)


def _batches():
    return {label: _batch(*args)[0] for label, (args, _, _) in CASES.items()}


def check_batches(fixed_upstream: bool):
    import itertools

    from fixes.entries.elastic_batch_exceeds_max import _CANDIDATES, reproduce as elastic

    harness.setup()
    module = _CANDIDATES.owner_and_name()[0]
    fixed = {label: elastic.ALLOWED_BATCH if want is None else want for label, (_, _, want) in CASES.items()}
    if fixed_upstream:
        assert _batches() == fixed
        return
    assert _batches() == {label: unfixed for label, (_, unfixed, _) in CASES.items()}
    sets = [list(s) for size in (2, 3) for s in itertools.combinations(range(1, 13), size)]
    unfixed = {(tuple(s), cap): module._get_compatible_gpus_v01(s, cap)[0] for s in sets for cap in range(1, 61)
               if max(s) <= cap}
    fixes.apply(FIX_ID)
    try:
        assert _batches() == fixed
        # upstream's updated test_proper_mbsz: at world size 4 the batch per GPU is 6 and 3 is the micro batch
        assert _batch([1, 2, 3, 7], 32, world_size=4)[2] == 3
        for (micro, cap), old in unfixed.items():
            new = module._get_compatible_gpus_v01(list(micro), cap)[0]
            assert new <= cap, (micro, cap, new)
            if old <= cap:  # the LCM was within the cap, or lost the vote: the fix changes nothing
                assert new == old, (micro, cap, old, new)
        assert any(old > cap for (_, cap), old in unfixed.items())
    finally:
        fixes.revert(FIX_ID)


@pytest.mark.parametrize(("release", "fixed_upstream"), [("0.19.3", False), ("0.19.6", True)])
def test_when_applied_then_every_batch_is_within_the_cap_and_configs_whose_lcm_fits_are_unchanged(release,
                                                                                                  fixed_upstream):
    call_in_release(release, check_batches, args=(fixed_upstream,))
