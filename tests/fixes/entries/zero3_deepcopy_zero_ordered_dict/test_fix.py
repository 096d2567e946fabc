"""zero3-deepcopy-zero-ordered-dict in child processes: on its reproduce release (0.16.0, the only swept release
with the bug) and on the newest (fixed upstream). ZeRO-3 on one rank, CPU (gloo)."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.16.0"
FIX_ID = "zero3-deepcopy-zero-ordered-dict"
ERROR = 'can only concatenate tuple (not "list") to tuple'


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.zero3_deepcopy_zero_ordered_dict import _REDUCE

    return _REDUCE.owner_and_name()[0]


def _zero_ordered_dict():
    """A ZeROOrderedDict holding one plain parameter, its parent a Linear (no engine needed)."""
    import torch

    owner = _owner()
    parent = torch.nn.Linear(2, 2)
    params = owner(parent_module=parent)
    params["weight"] = parent.weight
    return params


def check_reduce_raises_and_the_fix_returns_upstreams_tuple():
    import copy
    import pickle

    import pytest

    import fixes

    params = _zero_ordered_dict()
    with pytest.raises(TypeError, match=r"can only concatenate tuple \(not \"list\"\) to tuple"):
        copy.deepcopy(params)
    with pytest.raises(TypeError, match=r"can only concatenate tuple"):
        pickle.dumps(params)
    fixes.apply(FIX_ID)
    try:
        reduced = params.__reduce__()
        assert isinstance(reduced, tuple) and reduced[1] == (params._parent_module,), reduced
        copied = copy.deepcopy(params)
        assert type(copied) is type(params) and list(copied) == ["weight"]
        assert copied._parent_module is not params._parent_module  # deep-copied with its parent
        assert copied["weight"].equal(params["weight"])
        loaded = pickle.loads(pickle.dumps(params))
        assert type(loaded) is type(params) and loaded["weight"].equal(params["weight"])
    finally:
        fixes.revert(FIX_ID)


def check_the_ema_copy_is_made_and_training_matches_plain_pytorch():
    import numpy as np

    import fixes
    from fixes import harness
    from fixes.entries.zero3_deepcopy_zero_ordered_dict.copies import initial_params, job, run, zero2_job

    _owner()
    broken = run(job())
    assert broken.bug_error, broken.error
    assert broken.error[1] == ERROR and broken.error[2] == "runtime/zero/parameter_offload.py:__reduce__", broken.error
    assert run(zero2_job()).error is None  # ZeRO-2 copies the same model
    fixes.apply(FIX_ID)
    try:
        for dtype in ("float32", "bfloat16"):
            fixed = run(job(dtype))
            assert fixed.error is None, fixed.error
            result = fixed.result
            assert all(np.array_equal(result["copy"][k], result["before"][k]) for k in result["before"])
            assert all(np.array_equal(result["copy_after"][k], result["copy"][k]) for k in result["copy"])
            harness.assert_close(result["copy"], initial_params(job(dtype)), dtype, f"{dtype}: the copy")
            reference = harness.train_reference(job(dtype))
            harness.assert_close(result["after"], reference.params, dtype, f"{dtype}: weights")
            harness.assert_close(result["losses"], reference.losses, dtype, f"{dtype}: losses")
        plain = run(job(), gathered=False)  # outside GatheredParameters: the copy holds no weights
        assert plain.error is None and set(plain.result["shapes"].values()) == {(0,)}, plain.result.get("shapes")
    finally:
        fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    def __reduce__(self):
        r0, _, *r2 = super(type(self), self).__reduce__()
        return (r0, (self._parent_module, )) + r2 + ()  # still the bug, but not the code the fix knows

    owner = _owner()
    assert_drift_refused(FIX_ID, owner, "__reduce__", __reduce__)
    assert not fixes.get(FIX_ID).applied


def check_fixed_release_is_a_noop():
    import copy

    import fixes

    params = _zero_ordered_dict()
    assert_noop_on_fixed_release(FIX_ID, _owner())
    assert "does not add the list r2 to a tuple" in fixes.get(FIX_ID).probe().evidence
    assert list(copy.deepcopy(params)) == ["weight"]


def test_when_a_zero_ordered_dict_is_copied_then_type_error_and_with_the_fix_it_copies_and_pickles():
    call_in_release(AFFECTED, check_reduce_raises_and_the_fix_returns_upstreams_tuple)


def test_when_an_ema_copy_is_made_then_it_fails_and_with_the_fix_holds_the_weights_and_training_matches():
    call_in_release(AFFECTED, check_the_ema_copy_is_made_and_training_matches_plain_pytorch)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
