import importlib
import pkgutil

import pytest

import fixes
from fixes import registry
from fixes.exceptions import DriftError, UnknownFixError


def test_when_listing_then_every_entry_module_is_registered():
    modules = {m.name for m in pkgutil.iter_modules(fixes.__path__)} - registry.FRAMEWORK_MODULES
    assert {fix_id.replace("-", "_") for fix_id in fixes.available()} == modules
    assert "zero3-linear-setup-context" in fixes.available()


def test_when_listing_then_no_entry_module_imports_deepspeed_or_torch():
    import sys

    for fix_id in fixes.available():
        importlib.import_module(f"fixes.{fix_id.replace('-', '_')}")
    assert "deepspeed" not in sys.modules


def test_when_id_unknown_then_error_lists_known_ids():
    with pytest.raises(UnknownFixError) as caught:
        fixes.get("no-such-bug")
    assert "no-such-bug" in str(caught.value) and "zero3-linear-setup-context" in str(caught.value)
    assert isinstance(caught.value, fixes.FixbookError)


def test_when_one_of_several_ids_unknown_then_nothing_is_applied(monkeypatch):
    applied = []
    fix = fixes.get("zero3-linear-setup-context")
    monkeypatch.setattr(fix, "apply", lambda: applied.append(fix.id))
    with pytest.raises(UnknownFixError):
        fixes.apply("zero3-linear-setup-context", "no-such-bug")
    assert applied == []


class _Stub:
    def __init__(self, fix_id, fail=False):
        self.id, self.fail, self.calls = fix_id, fail, []

    def apply(self):
        if self.fail:
            raise DriftError("drifted")
        self.calls.append("apply")
        return fixes.Outcome(self.id, "applied", "ok")

    def revert(self):
        self.calls.append("revert")
        return fixes.Outcome(self.id, "reverted", "ok")


def test_when_a_later_fix_drifts_then_earlier_ones_from_the_same_call_are_reverted(monkeypatch):
    good, bad = _Stub("good"), _Stub("bad", fail=True)
    monkeypatch.setattr(registry, "_entries", lambda: {"good": good, "bad": bad})
    with pytest.raises(DriftError):
        fixes.apply("good", "bad")
    assert good.calls == ["apply", "revert"]


def test_every_entry_metadata_is_complete_and_consistent():
    from ci import releases

    known = releases.load()
    for fix in fixes.all_fixes():
        info = fix.info
        assert info.title and info.summary and info.root_cause and info.error_signatures and info.components
        assert ".py" in info.root_cause, f"{info.id}: root cause must name the DeepSpeed file"
        assert info.reproduce_release in known.releases, f"{info.id}: reproduce release not installed by ci/"
        assert info.expected_affected(known.newest) is not None, f"{info.id}: newest release not swept"
        if info.reproduced_here:
            assert info.expected_affected(info.reproduce_release), f"{info.id}: reproduce release not measured affected"
        assert fix.targets, f"{info.id}: a fix must declare the targets its drift check covers"
