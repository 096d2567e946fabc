"""The apply/revert protocol of fixes.fix.Fix, on a synthetic target (no DeepSpeed needed)."""
import sys
import types
from pathlib import Path

import pytest

from fixes.exceptions import DriftError, PatchError
from fixes.fix import Fix, FixInfo, Probe
from fixes.patching import AttributePatch, Target, fingerprint

MODULE = "fixbook_fake_target"

SOURCE = '''
class Widget:
    @staticmethod
    def compute(ctx, x):
        return x * 2
'''


def _load_target(source: str = SOURCE) -> types.ModuleType:
    import linecache

    path = f"<{MODULE}>"
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)
    module = types.ModuleType(MODULE)
    exec(compile(source, path, "exec"), module.__dict__)
    sys.modules[MODULE] = module
    return module


ORIGINAL_FINGERPRINT = fingerprint(vars(_load_target().Widget)["compute"])


class FakeFix(Fix):
    info = FixInfo(id="fake-fix", title="t", summary="s", symptom="crash", components=("test",),
                   error_signatures=("boom",), root_cause="fixbook_fake_target.Widget.compute",
                   reproduce_release="0.18.9", upstream_fixed_in="0.19.8")
    targets = (Target(MODULE, "Widget.compute"),)

    def known_fingerprints(self, target: Target) -> dict[str, tuple[str, ...]]:
        return {ORIGINAL_FINGERPRINT: ("0.18.9",)}

    def read_code(self) -> Probe:
        fixed = hasattr(sys.modules[MODULE].Widget, "fixed")
        return Probe(not fixed, "Widget has fixed" if fixed else "Widget lacks fixed")

    def patches(self) -> list[AttributePatch]:
        widget = sys.modules[MODULE].Widget
        return [AttributePatch(widget, "compute", staticmethod(lambda x: x * 3)),
                AttributePatch(widget, "fixed", True)]


@pytest.fixture
def widget():
    module = _load_target()
    yield module.Widget
    sys.modules.pop(MODULE, None)


def test_when_applied_twice_then_second_apply_is_a_noop(widget):
    fix = FakeFix()
    assert fix.apply().action == "applied"
    patched = vars(widget)["compute"]
    assert fix.apply().action == "already applied"
    assert vars(widget)["compute"] is patched
    fix.revert()


def test_when_reverted_then_exact_original_objects_are_restored(widget):
    original = vars(widget)["compute"]
    fix = FakeFix()
    fix.apply()
    assert widget.compute(5) == 15 and widget.fixed is True
    outcome = fix.revert()
    assert outcome.action == "reverted"
    assert vars(widget)["compute"] is original
    assert "fixed" not in vars(widget)
    assert fix.revert().action == "not applied"


def test_when_target_code_edited_then_drift_error_and_nothing_patched(widget):
    module = _load_target(SOURCE.replace("x * 2", "x * 2 + 0"))
    before = dict(vars(module.Widget))
    with pytest.raises(DriftError, match="not the code this fix was written for"):
        FakeFix().apply()
    assert dict(vars(module.Widget)) == before


def test_when_target_signature_changed_then_drift_error_and_nothing_patched(widget):
    module = _load_target(SOURCE.replace("def compute(ctx, x):", "def compute(ctx, x, param_padding=0):"))
    before = dict(vars(module.Widget))
    fix = FakeFix()
    with pytest.raises(DriftError):
        fix.apply()
    assert dict(vars(module.Widget)) == before and not fix.applied


def test_when_release_already_fixed_then_apply_is_a_noop_that_says_why(widget):
    widget.fixed = True
    original = vars(widget)["compute"]
    outcome = FakeFix().apply()
    assert outcome.action == "not needed" and not outcome.changed
    assert "not affected" in outcome.message and "Widget has fixed" in outcome.message
    assert vars(widget)["compute"] is original


def test_when_a_patch_fails_midway_then_earlier_patches_are_rolled_back(widget):
    original = vars(widget)["compute"]

    class Exploding(FakeFix):
        def patches(self):
            return [*super().patches()[:1], AttributePatch(object, "nope", 1)]  # builtins refuse setattr

    fix = Exploding()
    with pytest.raises(PatchError, match="rolled back"):
        fix.apply()
    assert vars(widget)["compute"] is original and not fix.applied


def test_when_metadata_has_a_bad_release_string_then_it_is_rejected():
    with pytest.raises(ValueError, match="not a DeepSpeed release number"):
        FixInfo(id="x", title="t", summary="s", symptom="crash", components=(), error_signatures=(),
                root_cause="r", reproduce_release="latest")


class Requiring(Fix):
    """Patches another attribute of the same target, and needs FakeFix on releases that have its bug."""

    info = FixInfo(id="fake-requiring", title="t", summary="s", symptom="silent wrong result", components=("test",),
                   error_signatures=("boom",), root_cause="fixbook_fake_target.Widget",
                   reproduce_release="0.18.9")
    targets = ()
    requires = ("fake-fix",)

    def read_code(self) -> Probe:
        return Probe(not hasattr(sys.modules[MODULE].Widget, "also"), "Widget lacks also")

    def patches(self) -> list[AttributePatch]:
        return [AttributePatch(sys.modules[MODULE].Widget, "also", True)]


@pytest.fixture
def registered(monkeypatch, widget):
    from fixes import registry

    entries = {"fake-fix": FakeFix(), "fake-requiring": Requiring()}
    monkeypatch.setattr(registry, "_entries", lambda: entries)
    return entries


def test_when_a_fix_requires_another_then_apply_turns_both_on_and_revert_both_off(registered, widget):
    original = dict(vars(widget))
    outcome = registered["fake-requiring"].apply()
    assert "also applied fake-fix" in outcome.message
    assert registered["fake-fix"].applied and widget.also is True
    registered["fake-requiring"].revert()
    assert dict(vars(widget)) == original and not registered["fake-fix"].applied


def test_when_the_required_fix_was_applied_first_then_revert_leaves_it(registered):
    registered["fake-fix"].apply()
    registered["fake-requiring"].apply()
    registered["fake-requiring"].revert()
    assert registered["fake-fix"].applied
    registered["fake-fix"].revert()


def test_when_the_required_fix_drifted_then_nothing_is_patched(registered):
    module = _load_target(SOURCE.replace("x * 2", "x * 4"))
    before = dict(vars(module.Widget))
    with pytest.raises(DriftError):
        registered["fake-requiring"].apply()
    assert dict(vars(module.Widget)) == before
    assert not registered["fake-requiring"].applied and not registered["fake-fix"].applied


def _swept(monkeypatch, statuses):
    from fixes import measured

    sweep = measured.EntrySweep("x", {r: measured.Observation(r, s) for r, s in statuses.items()})
    monkeypatch.setattr(measured, "for_entry", lambda entry_id: sweep)


def _info(**upstream):
    return FixInfo(id="x", title="t", summary="s", symptom="crash", components=(), error_signatures=(),
                   root_cause="r", reproduce_release="0.18.4", **upstream)


def test_when_measured_first_fixed_differs_from_upstream_then_disagreement_names_it(monkeypatch):
    _swept(monkeypatch, {"0.18.2": "not affected", "0.18.4": "affected", "0.18.5": "affected", "0.19.0": "not affected"})
    text = _info(upstream_fixed_in="0.18.5", upstream_introduced="0.18.3").upstream_disagreement
    assert text == ("upstream says fixed in 0.18.5; still affected on 0.18.5; upstream says introduced in 0.18.3; "
                    "the first release measured affected is 0.18.4")


def test_when_measured_range_matches_upstream_then_there_is_no_disagreement(monkeypatch):
    _swept(monkeypatch, {"0.18.2": "not affected", "0.18.3": "affected", "0.18.5": "not affected"})
    info = _info(upstream_fixed_in="0.18.5", upstream_introduced="0.18.3")
    assert info.upstream_disagreement is None
    assert info.affected_releases == ["0.18.3"] and info.expected_affected("0.18.5") is False


def test_when_upstream_introduced_it_before_the_oldest_release_measured_then_a_range_starting_there_agrees(monkeypatch):
    _swept(monkeypatch, {"0.14.4": "affected", "0.18.4": "affected", "0.18.5": "not affected"})
    assert _info(upstream_fixed_in="0.18.5", upstream_introduced="0.14.3").upstream_disagreement is None
    text = _info(upstream_fixed_in="0.18.5", upstream_introduced="0.15.0").upstream_disagreement
    assert text == "upstream says introduced in 0.15.0; the first release measured affected is 0.14.4"


def test_when_a_fix_fails_after_its_requirement_applied_then_the_requirement_is_rolled_back(registered, widget):
    original = dict(vars(widget))

    class Breaking(Requiring):
        def patches(self) -> list[AttributePatch]:
            raise RuntimeError("cannot build the patch")

    with pytest.raises(PatchError, match="rolled back.*cannot build the patch"):
        Breaking().apply()
    assert dict(vars(widget)) == original
    assert not registered["fake-fix"].applied


def test_when_checked_for_applicability_then_nothing_is_patched_and_drift_is_raised(registered):
    module = _load_target(SOURCE.replace("x * 2", "x * 4"))
    before = dict(vars(module.Widget))
    with pytest.raises(DriftError):
        registered["fake-requiring"].check_applicable()
    assert dict(vars(module.Widget)) == before


def test_when_patches_itself_finds_drift_after_a_requirement_applied_then_drift_error_and_all_undone(registered, widget):
    original = dict(vars(widget))

    class DriftInPatches(Requiring):
        def patches(self) -> list[AttributePatch]:
            raise DriftError("Widget.table is not the code this fix was written for")

    with pytest.raises(DriftError, match="Widget.table"):
        DriftInPatches().apply()
    assert dict(vars(widget)) == original and not registered["fake-fix"].applied


def test_when_applied_then_the_probe_answers_from_the_fix_itself_not_the_code(widget, monkeypatch):
    fix = FakeFix()
    fix.apply()
    monkeypatch.setattr(fix, "read_code", lambda: (_ for _ in ()).throw(AssertionError("code read while applied")))
    probe = fix.probe()
    assert not probe.affected and "fixes.apply('fake-fix')" in probe.evidence and "Widget.compute" in probe.evidence
    monkeypatch.undo()
    fix.revert()
    assert fix.probe().affected  # reverted: the code is read again


class Layered(Fix):
    """Patches the object FakeFix patches (as two entries' fixes of one DeepSpeed function do). Its id sorts before
    FakeFix's, so an id-ordered revert would take FakeFix's patch off first."""

    info = FixInfo(id="a-layered", title="t", summary="s", symptom="crash", components=("test",),
                   error_signatures=("boom",), root_cause="fixbook_fake_target.Widget.compute",
                   reproduce_release="0.18.9")
    targets = ()

    def read_code(self) -> Probe:
        return Probe(True, "always")

    def patches(self) -> list[AttributePatch]:
        return [AttributePatch(sys.modules[MODULE].Widget, "compute", staticmethod(lambda x: x * 5))]


@pytest.fixture
def layered(monkeypatch, widget):
    from fixes import registry

    entries = {"a-layered": Layered(), "fake-fix": FakeFix()}
    monkeypatch.setattr(registry, "_entries", lambda: entries)
    return entries


def test_when_two_fixes_patch_one_object_then_revert_all_takes_them_off_last_applied_first(layered, widget):
    from fixes import registry

    original = dict(vars(widget))
    layered["fake-fix"].apply()
    layered["a-layered"].apply()
    assert widget.compute(1) == 5
    outcomes = registry.revert()
    assert [o.fix_id for o in outcomes] == ["a-layered", "fake-fix"]
    assert dict(vars(widget)) == original and widget.compute(None, 1) == 2


def test_when_a_fix_patched_over_is_reverted_alone_then_it_refuses_and_nothing_changes(layered, widget):
    from fixes import registry

    original = dict(vars(widget))
    layered["fake-fix"].apply()
    layered["a-layered"].apply()
    with pytest.raises(PatchError, match="revert that first"):
        layered["fake-fix"].revert()
    assert widget.compute(1) == 5 and layered["fake-fix"].applied
    outcomes = registry.revert("fake-fix", "a-layered")  # named in any order: reverted last applied first
    assert [o.fix_id for o in outcomes] == ["fake-fix", "a-layered"]
    assert dict(vars(widget)) == original


class Covered(Fix):
    """A bug in the code FakeFix replaces: gone once FakeFix is applied (as when two entries' fixes replace one
    DeepSpeed function and the first one's replacement has the second's fix too)."""

    info = FixInfo(id="z-covered", title="t", summary="s", symptom="crash", components=("test",),
                   error_signatures=("boom",), root_cause="fixbook_fake_target.Widget.compute",
                   reproduce_release="0.18.9")
    targets = ()

    def read_code(self) -> Probe:
        fixed = hasattr(sys.modules[MODULE].Widget, "fixed")
        return Probe(not fixed, "replaced" if fixed else "original compute")

    def patches(self) -> list[AttributePatch]:
        return [AttributePatch(sys.modules[MODULE].Widget, "covered", True)]


def test_when_a_fix_applied_earlier_in_apply_all_removes_another_bug_then_that_one_says_not_needed(monkeypatch, widget):
    from fixes import fix as fix_module
    from fixes import registry

    entries = {"fake-fix": FakeFix(), "z-covered": Covered()}
    monkeypatch.setattr(registry, "_entries", lambda: entries)
    monkeypatch.setattr(registry, "installed_deepspeed", lambda: "0.18.9")
    monkeypatch.setattr(fix_module, "installed_deepspeed", lambda: "0.18.9")
    outcomes = {o.fix_id: o for o in registry.apply()}
    assert outcomes["fake-fix"].action == "applied"
    assert outcomes["z-covered"].action == "not needed" and "replaced the same code" in outcomes["z-covered"].message
    assert not entries["z-covered"].applied and not hasattr(widget, "covered")
    registry.revert()


def test_when_info_toml_is_read_then_lists_are_tuples_and_a_bad_file_is_named(tmp_path):
    from fixes.fix import INFO_FILE

    path = tmp_path / INFO_FILE
    path.write_text('id = "x"\ntitle = "t"\nsummary = "s"\nsymptom = "crash"\ncomponents = ["ZeRO-3"]\n'
                    'error_signatures = ["boom"]\nroot_cause = "r"\nreproduce_release = "0.18.2"\n'
                    'upstream_prs = [7665]\n')
    info = FixInfo.read(path)
    assert info.components == ("ZeRO-3",) and info.upstream_prs == (7665,) and info.kind == "bug"
    path.write_text(path.read_text() + 'colour = "red"\n')
    with pytest.raises(ValueError, match=r"info\.toml: unknown field\(s\) colour"):
        FixInfo.read(path)
    path.write_text('id = "x"\ntitle = \n')
    with pytest.raises(ValueError, match="not valid TOML"):
        FixInfo.read(path)
    path.write_text('id = "x"\n')
    with pytest.raises(ValueError, match="missing"):
        FixInfo.read(path)


def test_when_every_entry_states_its_metadata_then_it_is_in_info_toml_only():
    import fixes
    from fixes.fix import INFO_FILE

    for fix in fixes.all_fixes():
        package = Path(fixes.__file__).parent / "entries" / fix.id.replace("-", "_")
        assert FixInfo.read(package / INFO_FILE) == fix.info, fix.id
        assert "FixInfo(" not in (package / "__init__.py").read_text(), f"{fix.id}: metadata stated twice"
