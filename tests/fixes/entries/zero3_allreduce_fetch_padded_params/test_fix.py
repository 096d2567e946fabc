"""zero3-allreduce-fetch-padded-params: its source rewrite changes the stride line and nothing else, and refuses code
without exactly one such line (a drift shape of the rewrite itself, which the contract's drift check cannot make)."""
import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
FIX_ID = "zero3-allreduce-fetch-padded-params"
UNALIGNED = "start_param += param.ds_numel\n"
ALIGNED = "start_param += param.ds_numel_aligned\n"


def check_the_applied_function_is_the_original_with_one_line_changed():
    import difflib
    import inspect
    import textwrap

    harness.setup()
    from deepspeed.runtime.zero.partition_parameters import Init

    original = vars(Init)["_convert_to_deepspeed_param"]
    before = inspect.getsource(original)
    assert UNALIGNED in before and ALIGNED not in before
    fixes.apply(FIX_ID)
    try:
        patched = vars(Init)["_convert_to_deepspeed_param"]
        assert patched is not original and patched.__qualname__ == original.__qualname__
        assert patched.__globals__ is original.__globals__  # DeepSpeed's module globals, looked up live
        assert patched.__code__.co_firstlineno == original.__code__.co_firstlineno
        after = inspect.getsource(patched)  # what runs, as linecache holds it for the new function (dedented)
        changed = [line for line in difflib.ndiff(textwrap.dedent(before).splitlines(True), after.splitlines(True))
                   if line[:2] in ("- ", "+ ")]
        assert [line[2:].strip() for line in changed] == [UNALIGNED.strip(), ALIGNED.strip()], changed
    finally:
        fixes.revert(FIX_ID)


def check_rewrite_refuses_code_without_exactly_one_unaligned_stride():
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


def test_when_applied_then_the_function_differs_from_the_installed_one_in_the_stride_line_only():
    call_in_release(AFFECTED, check_the_applied_function_is_the_original_with_one_line_changed)


def test_when_the_stride_line_is_not_there_once_then_the_rewrite_raises_drift_error():
    call_in_release(AFFECTED, check_rewrite_refuses_code_without_exactly_one_unaligned_stride)
