"""zero3-allreduce-fetch-padded-params on its last affected release (0.19.3), the oldest measured one (0.16.0, where
the all_reduce branch is inline in the nested all_gather_coalesced), the first fixed one (0.19.4) and the newest,
in child processes; two ZeRO-3 ranks on CPU (gloo)."""
from ci import releases
from tests.helpers import assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.3"
FIX_ID = "zero3-allreduce-fetch-padded-params"
UNALIGNED = "start_param += param.ds_numel\n"
ALIGNED = "start_param += param.ds_numel_aligned\n"


def _init_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.partition_parameters import Init

    return Init


def check_the_applied_function_is_the_original_with_one_line_changed():
    import difflib
    import inspect
    import textwrap

    import fixes

    init = _init_class()
    original = vars(init)["_convert_to_deepspeed_param"]
    before = inspect.getsource(original)
    assert UNALIGNED in before and ALIGNED not in before
    assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
    try:
        patched = vars(init)["_convert_to_deepspeed_param"]
        assert patched is not original and patched.__qualname__ == original.__qualname__
        assert patched.__globals__ is original.__globals__  # DeepSpeed's module globals, looked up live
        assert patched.__code__.co_firstlineno == original.__code__.co_firstlineno
        after = inspect.getsource(patched)  # what runs, as linecache holds it for the new function (dedented)
        changed = [line for line in difflib.ndiff(textwrap.dedent(before).splitlines(True), after.splitlines(True))
                   if line[:2] in ("- ", "+ ")]
        assert [line[2:].strip() for line in changed] == [UNALIGNED.strip(), ALIGNED.strip()], changed
    finally:
        fixes.revert(FIX_ID)
    assert vars(init)["_convert_to_deepspeed_param"] is original


def check_the_first_forward_sees_wrong_weights_and_with_the_fix_the_built_ones():
    from fixes import harness
    from fixes.entries.zero3_allreduce_fetch_padded_params.fetch import fetch_job, run

    _init_class()
    for dtype in ("float32", "bfloat16"):
        broken = run(fetch_job(dtype))
        # each Linear's bias follows its padded weight in the coalesced fetch: its first element gets the padding
        assert broken.wrong == ({"fc1.bias": [0], "fc2.bias": [0]},) * 2, broken
        harness.assert_differs(broken.losses, broken.reference_losses, dtype, f"{dtype}: losses, no fix")
        fixed = run(fetch_job(dtype, fixes=(FIX_ID, )))
        assert fixed.wrong == ({}, {}), fixed  # exactly the weights the model was built with, on both ranks
        harness.assert_close(fixed.losses, fixed.reference_losses, dtype, f"{dtype}: losses, fixed")
        harness.assert_close(fixed.params, fixed.reference_params, dtype, f"{dtype}: weights, fixed")


def check_rewrite_refuses_code_without_exactly_one_unaligned_stride():
    import fixes
    from fixes.entries.zero3_allreduce_fetch_padded_params import realigned

    def twice(params):
        start_param = 0
        for param in params:
            start_param += param.ds_numel
        for param in params:
            start_param += param.ds_numel
        return start_param

    try:
        realigned(twice)
    except fixes.DriftError as exc:
        assert "found it 2 times" in str(exc), exc
    else:
        raise AssertionError("a function with the line twice was rewritten")


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _init_class())
    assert "advances start_param by ds_numel_aligned" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_then_the_function_differs_from_the_installed_one_in_the_stride_line_only():
    call_in_release(AFFECTED, check_the_applied_function_is_the_original_with_one_line_changed)


def test_when_params_are_padded_then_the_forward_sees_wrong_weights_and_with_the_fix_matches_plain_pytorch():
    call_in_release(AFFECTED, check_the_first_forward_sees_wrong_weights_and_with_the_fix_the_built_ones)


def test_when_the_stride_line_is_not_there_once_then_the_rewrite_raises_drift_error():
    call_in_release(AFFECTED, check_rewrite_refuses_code_without_exactly_one_unaligned_stride)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
