import inspect
import textwrap
import types

import pytest

from fixes.exceptions import DriftError
from fixes.patching import MISSING, AttributePatch, Target, fingerprint


def _function_from(source: str) -> types.FunctionType:
    namespace: dict = {}
    path = "<test>"
    import linecache

    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    exec(compile(source, path, "exec"), namespace)
    return namespace["f"]


def test_when_only_comments_and_blank_lines_change_then_fingerprint_is_equal():
    plain = _function_from("def f(x):\n    return x + 1\n")
    commented = _function_from("def f(x):\n    # why\n\n    return x + 1  # note\n")
    assert fingerprint(plain) == fingerprint(commented)


def test_when_code_changes_then_fingerprint_differs():
    assert fingerprint(_function_from("def f(x):\n    return x + 1\n")) != fingerprint(
        _function_from("def f(x):\n    return x + 2\n"))


def test_when_signature_gains_a_keyword_then_fingerprint_differs():
    assert fingerprint(_function_from("def f(x):\n    return x\n")) != fingerprint(
        _function_from("def f(x, param_padding=0):\n    return x\n"))


def test_when_target_is_staticmethod_then_fingerprint_reads_its_function():
    class Holder:
        @staticmethod
        def f(x):
            return x

    assert fingerprint(vars(Holder)["f"]) == fingerprint(Holder.f)


def test_when_patch_reverted_then_exact_original_and_absent_attributes_return():
    class Holder:
        value = staticmethod(len)

    original = vars(Holder)["value"]
    replace, add = AttributePatch(Holder, "value", 1), AttributePatch(Holder, "extra", 2)
    replace.apply(), add.apply()
    assert (Holder.value, Holder.extra) == (1, 2)
    assert add.original is MISSING
    add.revert(), replace.revert()
    assert vars(Holder)["value"] is original
    assert "extra" not in vars(Holder)


def test_when_target_attribute_is_missing_then_drift_error_names_it():
    with pytest.raises(DriftError, match="os.no_such_function"):
        Target("os", "no_such_function").check({"x": ("1.0",)})


def test_when_target_module_missing_then_drift_error_for_missing_parent():
    with pytest.raises(DriftError, match="'Nope' does not exist in the installed"):
        Target("os", "Nope.method").check({})


def test_when_fingerprint_unknown_then_drift_error_lists_known_ones():
    target = Target("textwrap", "dedent")
    with pytest.raises(DriftError, match=r"0000000000000000 \(0\.1\).*Nothing was patched"):
        target.check({"0000000000000000": ("0.1",)})
    assert textwrap.dedent is vars(textwrap)["dedent"]


def test_when_a_patch_wraps_a_method_with_wrapped_then_undecorated_reads_the_code_underneath():
    from fixes.patching import undecorated

    def original(x):
        return x

    def wrapper(x):
        return original(x)

    wrapper.__wrapped__ = original
    assert undecorated(wrapper) is original
    assert undecorated(original) is original


def _halve(value, factor=2):
    return value / factor


def test_when_a_function_is_recompiled_with_an_edit_then_it_runs_the_edit_and_keeps_its_identity():
    from fixes.patching import edited_source, recompiled

    new = recompiled(_halve, edited_source(_halve, "value / factor", "value * factor", "tests._halve"), "test")
    assert new(3) == 6 and _halve(3) == 1.5
    assert new.__name__ == "_halve" and new.__wrapped__ is _halve and new.__defaults__ == (2,)
    assert "value * factor" in inspect.getsource(new.__code__)  # getsource(new) follows __wrapped__
    # the installed file's line numbers: a traceback points where a reader finds the function
    assert new.__code__.co_firstlineno == _halve.__code__.co_firstlineno


def test_when_the_edited_text_is_absent_or_repeated_then_drift_error_and_nothing_is_made():
    from fixes.patching import edited_source

    with pytest.raises(DriftError, match="found it 0 times"):
        edited_source(_halve, "value // factor", "value", "tests._halve")
    with pytest.raises(DriftError, match="found it 2 times"):
        edited_source(_halve, "factor", "f", "tests._halve")
