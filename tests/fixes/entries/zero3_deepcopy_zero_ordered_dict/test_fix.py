"""zero3-deepcopy-zero-ordered-dict on its reproduce release (0.16.0), in child processes: upstream's ``__reduce__``
for copy and pickle, and the copies the bug never touched (ZeRO-2, outside GatheredParameters)."""
from tests.helpers import call_in_release

AFFECTED = "0.16.0"
FIX_ID = "zero3-deepcopy-zero-ordered-dict"


def check_reduce_raises_and_the_fix_returns_upstreams_tuple():
    import copy
    import pickle

    import pytest
    import torch
    import fixes
    from fixes.entries.zero3_deepcopy_zero_ordered_dict import _REDUCE
    from fixes.harness import setup

    setup()
    parent = torch.nn.Linear(2, 2)
    params = _REDUCE.owner_and_name()[0](parent_module=parent)  # a ZeROOrderedDict, no engine needed
    params["weight"] = parent.weight
    with pytest.raises(TypeError, match=r"can only concatenate tuple \(not \"list\"\) to tuple"):
        copy.deepcopy(params)
    with pytest.raises(TypeError, match=r"can only concatenate tuple"):
        pickle.dumps(params)
    fixes.apply(FIX_ID)
    reduced = params.__reduce__()
    assert isinstance(reduced, tuple) and reduced[1] == (params._parent_module,), reduced
    copied = copy.deepcopy(params)
    assert type(copied) is type(params) and list(copied) == ["weight"]
    assert copied._parent_module is not params._parent_module  # deep-copied with its parent
    assert copied["weight"].equal(params["weight"])
    loaded = pickle.loads(pickle.dumps(params))
    assert type(loaded) is type(params) and loaded["weight"].equal(params["weight"])


def check_copies_the_bug_never_touched():
    import fixes
    from fixes.entries.zero3_deepcopy_zero_ordered_dict.copies import job, run, zero2_job
    from fixes.harness import setup

    setup()
    assert run(zero2_job()).error is None  # ZeRO-2 copies the same model
    fixes.apply(FIX_ID)
    plain = run(job(), gathered=False)  # outside GatheredParameters: the copy holds no weights
    assert plain.error is None and set(plain.result["shapes"].values()) == {(0,)}, plain.result.get("shapes")


def test_when_a_zero_ordered_dict_is_copied_then_type_error_and_with_the_fix_it_copies_and_pickles():
    call_in_release(AFFECTED, check_reduce_raises_and_the_fix_returns_upstreams_tuple)


def test_when_zero2_or_outside_gathered_parameters_then_the_copy_is_made_as_before():
    call_in_release(AFFECTED, check_copies_the_bug_never_touched)
