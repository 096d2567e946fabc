import importlib
import pkgutil
from pathlib import Path
from types import SimpleNamespace

import pytest

import fixes
from fixes import registry
from fixes.exceptions import DriftError, UnknownFixError
from tests.fixes.checks_registry import check_apply_all_then_one_training_step
from tests.helpers import call_in_release


def test_when_listing_then_every_entry_package_is_registered():
    import fixes.entries

    packages = {m.name for m in pkgutil.iter_modules(fixes.entries.__path__) if m.ispkg}
    assert {fix_id.replace("-", "_") for fix_id in fixes.available()} == packages
    assert "zero3-linear-setup-context" in fixes.available()


def test_when_listing_then_no_entry_module_imports_deepspeed_torch_or_the_harness():
    import subprocess
    import sys

    code = ("import sys, fixes; fixes.available(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('deepspeed', 'torch') or m == 'fixes.harness'"
            " or m.endswith('.reproduce')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


def test_when_one_fix_is_asked_for_then_only_its_entry_is_imported():
    import subprocess
    import sys

    code = ("import sys, fixes; fix = fixes.get('zero12-flat-buffer-detach'); "
            "print(fix.id, sorted(m for m in sys.modules if m.startswith('fixes.entries.') and m.count('.') == 2))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["zero12-flat-buffer-detach", "['fixes.entries.zero12_flat_buffer_detach']"]


@pytest.mark.parametrize("fix_id", ["zero12_flat_buffer_detach", "harness", "../harness", "Zero12-flat-buffer-detach",
                                    "", "zero12-flat-buffer-detach.reproduce"])
def test_when_an_id_names_no_entry_then_get_says_unknown(fix_id):
    with pytest.raises(UnknownFixError):
        fixes.get(fix_id)


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
    def __init__(self, fix_id, fail=False, kind="bug"):
        self.id, self.fail, self.calls = fix_id, fail, []
        self.info = SimpleNamespace(kind=kind, title=f"{fix_id}'s title")

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


class _Entry(_Stub):
    """A registered fix for the no-ids form: affected, and applied until reverted."""

    def __init__(self, fix_id, fail=None, probe_fails=False, kind="bug"):
        super().__init__(fix_id, kind=kind)
        self.failure, self.probe_fails, self.applied = fail, probe_fails, False

    def is_affected(self):
        if self.probe_fails:
            raise ValueError("probe exploded")
        return True

    def apply(self):
        if self.failure:
            raise self.failure
        self.applied = True
        return super().apply()


def test_when_no_ids_and_one_fix_drifts_then_the_others_are_applied_and_it_is_named(monkeypatch):
    good, drifted, broken = _Entry("good"), _Entry("drifted", DriftError("new code")), _Entry("broken", probe_fails=True)
    monkeypatch.setattr(registry, "_entries", lambda: {"broken": broken, "drifted": drifted, "good": good})
    monkeypatch.setattr(registry, "installed_deepspeed", lambda: "0.18.9")
    with pytest.warns(fixes.FixbookWarning) as warned:
        outcomes = fixes.apply()
    assert {o.fix_id: o.action for o in outcomes} == {"broken": "failed", "drifted": "refused", "good": "applied"}
    assert good.calls == ["apply"]
    assert "probe exploded" in {o.fix_id: o.message for o in outcomes}["broken"]
    assert {str(w.message).split()[1] for w in warned} == {"broken", "drifted"}


def test_when_no_ids_then_a_behaviour_change_is_not_applied_and_says_why(monkeypatch):
    bug, change = _Entry("a-bug"), _Entry("b-change", kind="behaviour change")
    monkeypatch.setattr(registry, "_entries", lambda: {"a-bug": bug, "b-change": change})
    monkeypatch.setattr(registry, "installed_deepspeed", lambda: "0.19.3")
    for strict in (False, True):
        bug.applied, bug.calls = False, []
        outcomes = {o.fix_id: o for o in fixes.apply(strict=strict)}
        assert {fix_id: o.action for fix_id, o in outcomes.items()} == {"a-bug": "applied", "b-change": "skipped"}
        assert bug.calls == ["apply"] and change.calls == [] and not change.applied, strict
        assert "not a bug" in outcomes["b-change"].message
        assert "fixes.apply('b-change')" in outcomes["b-change"].message


def test_when_a_behaviour_change_is_named_then_it_is_applied(monkeypatch):
    change = _Entry("b-change", kind="behaviour change")
    monkeypatch.setattr(registry, "_entries", lambda: {"b-change": change})
    assert [o.action for o in fixes.apply("b-change")] == ["applied"]
    assert change.calls == ["apply"] and change.applied


def test_when_no_ids_then_no_registered_behaviour_change_is_applied_under_any_release(monkeypatch):
    changes = [fix for fix in fixes.all_fixes() if fix.info.kind == "behaviour change"]
    assert changes, "no registered entry is a behaviour change"
    for fix in changes:
        monkeypatch.setattr(fix, "is_affected", lambda: True)
        monkeypatch.setattr(fix, "apply", lambda: pytest.fail("fixes.apply() applied a behaviour change"))
    monkeypatch.setattr(registry, "_entries", lambda: {fix.id: fix for fix in changes})
    monkeypatch.setattr(registry, "installed_deepspeed", lambda: "0.19.3")
    assert {o.fix_id: o.action for o in fixes.apply()} == {fix.id: "skipped" for fix in changes}


def test_when_no_ids_and_strict_then_one_drift_reverts_the_call(monkeypatch):
    good, drifted = _Entry("a-good"), _Entry("b-drifted", DriftError("new code"))
    monkeypatch.setattr(registry, "_entries", lambda: {"a-good": good, "b-drifted": drifted})
    with pytest.raises(DriftError):
        fixes.apply(strict=True)
    assert good.calls == ["apply", "revert"]


# fixes.apply() with no ids, then one training step, on the releases where some fix refused before
# (0.16.0, 0.16.6: code older than a fix; 0.19.7: the gather race rewritten), and on Python 3.12.
CHECKS = str(Path(__file__).with_name("checks_registry.py"))


@pytest.mark.parametrize("release", ["0.16.0", "0.16.6", "0.19.7"])
def test_when_apply_all_on_a_release_then_every_fix_that_applies_is_on_and_a_step_matches_plain_pytorch(release):
    call_in_release(release, check_apply_all_then_one_training_step, timeout=600)


def test_when_apply_all_under_python_3_12_then_fixes_apply_and_a_step_matches_plain_pytorch():
    from ci.releases import environments

    env = environments.get("colab-shape")
    if not env.is_installed():
        pytest.fail(f"environment {env.name} (Python {env.python}) is not built: bash ci/setup.sh")
    code = f"import runpy; runpy.run_path({CHECKS!r})['check_apply_all_then_one_training_step']()"
    done = environments.run_python(env, "0.18.9", ["-c", code], timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    assert "'zero3-gathered-params-cpu-race': 'applied'" in done.stdout  # a fingerprinted target, on 3.12


def test_when_no_deepspeed_is_installed_then_apply_all_says_so(monkeypatch):
    monkeypatch.setattr(registry, "installed_deepspeed", lambda: None)
    with pytest.raises(fixes.DeepSpeedNotInstalledError, match="not installed"):
        fixes.apply()


def test_when_an_entry_names_related_entries_then_each_is_registered_and_the_link_shows_at_both_ends():
    from fixes.card import card, related_ids

    named = {(fix.info.id, other) for fix in fixes.all_fixes() for other in fix.info.related}
    assert named, "no entry names a related entry"
    for fix_id, other in named:
        assert other in fixes.available() and other != fix_id, (fix_id, other)
        assert other in related_ids(fixes.get(fix_id).info) and fix_id in related_ids(fixes.get(other).info)
        assert f"`{fix_id}`" in card(fixes.get(other).info)  # the end that does not state the link shows it
