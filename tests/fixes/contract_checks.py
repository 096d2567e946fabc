"""The checks of the entry contract (``tests/fixes/test_contract.py``) that run inside one DeepSpeed release's
child process (``tests.helpers.call_in_release``), each given an entry's id: what every registered fix must do on
the installed code, read from the fix itself (its ``targets``, its ``patches()``, its ``reproduce()``), so that a
new entry is checked without a line of its own.

Each runs under the conditions the sweep measures the entry in (its ``measurement_context``, e.g. an older torch's
code path simulated, or a fix that unmasks this bug applied). The owners a check compares by identity are those of the fix's targets and of the patches it applies (and those of
the fixes it requires): every attribute stored on them must be the very object it was, not a copy.
"""
from __future__ import annotations

from typing import Any


def _fix(fix_id: str) -> Any:
    import fixes
    from fixes.harness import setup

    setup()
    return fixes.get(fix_id)


def _unique(objects: list[Any]) -> list[Any]:
    return list({id(o): o for o in objects}.values())


def _target_owners(fix: Any, missing_ok: bool = False) -> list[Any]:
    """The objects holding the fix's targets; with ``missing_ok`` (a fixed release, where upstream may have moved
    the code) those that still exist."""
    from fixes.exceptions import DeepSpeedNotInstalledError, DriftError

    owners = []
    for target in fix.targets:
        try:
            owners.append(target.owner_and_name()[0])
        except (DriftError, ImportError, DeepSpeedNotInstalledError):  # the module itself gone upstream
            if not missing_ok:
                raise
    return _unique(owners)


def _active_patches(fix: Any) -> list[Any]:
    """The patches the fix holds applied, and those of each requirement its apply() turned on."""
    patches = list(fix._active)
    for required in fix._applied_requirements:
        patches += _active_patches(required)
    return patches


def _in_place(patch: Any) -> bool:
    """Whether ``patch.new`` is stored where it patched, or under a patch set over it (a fix layered on its
    requirement's patch of the same method wraps it: ``__wrapped__``)."""
    from fixes.patching import stored_attribute

    stored = stored_attribute(patch.owner, patch.name)
    while stored is not patch.new:  # a patch may set a plain value (None, a flag): compared first
        stored = getattr(stored, "__wrapped__", None)
        if stored is None:
            return False
    return True


def _snapshots(owners: list[Any]) -> list[dict]:
    return [dict(vars(owner)) for owner in owners]


def _assert_same(owners: list[Any], before: list[dict], when: str) -> None:
    for owner, stored in zip(owners, before):
        after = vars(owner)
        name = getattr(owner, "__qualname__", getattr(owner, "__name__", repr(owner)))
        assert after.keys() == stored.keys(), f"{when}: attributes of {name} changed: {set(after) ^ set(stored)}"
        replaced = [key for key, value in stored.items() if after[key] is not value]
        assert not replaced, f"{when}: attributes of {name} replaced: {replaced}"


def _requirements_applied(fix: Any) -> dict[str, bool]:
    """Which of the fixes this one requires are applied (the measurement context may have applied one)."""
    import fixes

    return {required: fixes.get(required).applied for required in fix.requires}


def _actions(outcomes: list[Any]) -> list[str]:
    return [outcome.action for outcome in outcomes]


def check_probe(fix_id: str, expected: bool, reproduced: bool | None = None) -> None:
    """The probe and, where the sweep ran it here, the behavioural check (``reproduce()``), both under the
    conditions the sweep measures the entry in (``measurement_context``), say what the sweep measured on this
    release: ``expected`` its verdict (affected or not), ``reproduced`` what ``reproduce()`` returned (None: not
    run or could not tell, then only the probe is held to the verdict)."""
    fix = _fix(fix_id)
    with fix.measurement_context():
        assert not fix.applied, "the fix is applied before the probe"
        probe = fix.probe()
        assert probe.affected is expected, f"the probe says affected={probe.affected} ({probe.evidence}); the " \
                                           f"sweep measured affected={expected}"
        assert probe.evidence.strip(), "the probe gives no evidence"
        if reproduced is not None:
            assert fix.reproduce() is reproduced, f"reproduce() disagrees with the sweep's {reproduced}"
    print(f"{fix_id}: probe affected={probe.affected}: {probe.evidence}; reproduce() {reproduced}")


def check_apply_revert(fix_id: str) -> None:
    """On an affected release: apply → "applied", every patch in place; apply again → "already applied" and the
    same objects; the probe sees the fix; revert → "reverted" and every attribute of every owner the very object
    it was (the originals, by identity); revert again → "not applied"; and all of it again from the reverted
    state, which must be the state before."""
    fix = _fix(fix_id)
    with fix.measurement_context():
        _apply_revert(fix)


def _apply_revert(fix: Any) -> None:
    import fixes
    from fixes.patching import MISSING, stored_attribute

    fix_id = fix.id
    required_before = _requirements_applied(fix)
    targets = _target_owners(fix)
    before_targets = _snapshots(targets)
    assert fix.probe().affected, "the affected release does not probe as affected"
    assert _actions(fixes.apply(fix_id)) == ["applied"]
    patches = _active_patches(fix)
    assert patches, "apply() said applied and holds no patch"
    for patch in patches:  # in place: the stored object, or under a patch layered on it (its __wrapped__ chain)
        assert _in_place(patch), f"{patch.name} is not the patch"
    owners = _unique(targets + [patch.owner for patch in patches])
    patched = _snapshots(owners)
    assert _actions(fixes.apply(fix_id)) == ["already applied"]
    _assert_same(owners, patched, "a second apply")
    assert fix.applied and not fix.probe().affected, "the probe does not see the applied fix"
    assert _actions(fixes.revert(fix_id)) == ["reverted"]
    layered = {id(patch.new) for patch in patches}
    for patch in patches:
        if id(patch.original) in layered:  # set over another patch of this apply: the one under it restores
            continue
        restored = stored_attribute(patch.owner, patch.name)
        assert restored is patch.original, f"revert did not put back the original {patch.name}"
        assert patch.original is not MISSING or patch.name not in vars(patch.owner)
    _assert_same(targets, before_targets, "revert")
    assert not fix.applied and fix.probe().affected, "after revert the probe does not find the bug again"
    assert _requirements_applied(fix) == required_before, "revert left a requirement applied or took one off"
    assert _actions(fixes.revert(fix_id)) == ["not applied"]
    before = _snapshots(owners)
    assert _actions(fixes.apply(fix_id)) == ["applied"]
    assert _actions(fixes.revert(fix_id)) == ["reverted"]
    _assert_same(owners, before, "a second apply and revert")


def check_reproduction(fix_id: str) -> None:
    """The entry's behavioural check (``reproduce()``, what the sweep runs, inside its ``measurement_context``)
    finds the bug on an affected release; with the fix applied it does not; after revert it does again."""
    import fixes

    fix = _fix(fix_id)
    assert fix._reproduction() is not None, f"{fix_id} has no reproduce.py with reproduce(): the sweep cannot " \
                                            "measure its behaviour"
    with fix.measurement_context():
        assert fix.reproduce() is True, "the bug does not reproduce on this release"
        assert _actions(fixes.apply(fix_id)) == ["applied"]
        try:
            assert fix.reproduce() is False, "the bug still reproduces with the fix applied"
        finally:
            fixes.revert(fix_id)
        assert fix.reproduce() is True, "after revert the bug does not reproduce: the original code is not back"


def check_refused_and_still_reproduces(fix_id: str) -> None:
    """On an affected release whose code the fix was not written for (the sweep recorded it refusing): apply
    raises DriftError and patches nothing, and the bug still reproduces."""
    import fixes

    fix = _fix(fix_id)
    with fix.measurement_context():
        try:
            fixes.apply(fix_id)
        except fixes.DriftError as exc:
            assert "is not the code this fix was written for" in str(exc) or "no longer exists" in str(exc), exc
        else:
            raise AssertionError("the sweep recorded the fix refusing here, and it applied")
        assert not fix.applied
        assert fix.reproduce() is True, "the bug does not reproduce on this release"


def drifted(target: Any) -> Any:
    """The target as code the fix was not written for, that still has the bug (so the probe still finds it and
    only the drift check can refuse): the installed function's own bytecode, whose source (what the fingerprint
    and the probe read) has one more statement at the end. Of the same kind as stored (a staticmethod stays one).
    A target that is not a Python function (a scripted one) becomes a plain function calling it."""
    import ast
    import inspect
    import linecache
    import textwrap
    import types

    raw = target.raw()
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    function = target.code()
    if not inspect.isfunction(function):
        def replacement(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs)

        replacement.__name__ = getattr(function, "__name__", "replacement")
        return replacement
    source = textwrap.dedent(inspect.getsource(function))
    indent = " " * ast.parse(source).body[0].body[0].col_offset
    text = source.rstrip("\n") + f"\n{indent}fixbook_drift = None  # code the fix was not written for\n"
    filename = f"<fixbook drift of {target.dotted}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    copy = types.FunctionType(function.__code__.replace(co_filename=filename, co_firstlineno=1), function.__globals__,
                              function.__name__, function.__defaults__, function.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    return kind(copy) if kind else copy


def _installed(target: Any) -> bool:
    import fixes

    try:
        target.raw()
    except fixes.DriftError:
        return False
    return True


def check_drift_refused(fix_id: str) -> None:
    """On an affected release, each target in turn replaced by code the fix was not written for that keeps the bug
    (:func:`drifted`):
    apply raises DriftError naming that target, and patches nothing (every attribute of every owner the fix and
    its requirements patch is the same object; the fix and its requirements are not applied)."""
    fix = _fix(fix_id)
    assert fix.targets, f"{fix_id} declares no targets: its drift check covers nothing"
    with fix.measurement_context():
        _drift_refused(fix)


def _drift_refused(fix: Any) -> None:
    import fixes
    from fixes.patching import stored_attribute

    fix_id = fix.id
    required_before = _requirements_applied(fix)
    fix.check_applicable()  # the installed code is what it was written for: each refusal below is the drift's
    built = list(fix.patches())
    for required in fix.requires:
        if fixes.get(required).is_affected():
            built += fixes.get(required).patches()
    owners = _unique(_target_owners(fix) + [patch.owner for patch in built])
    # check_applicable passed, so a target missing here is one the fix accepts as absent on this release (an entry
    # whose target is one of two names, the release's own): there is nothing installed to drift. Every present one is.
    present = [target for target in fix.targets if _installed(target)]
    assert present, f"{fix_id}: none of its targets is installed, yet its fix is applicable"
    for target in present:
        owner, name = target.owner_and_name()
        original = stored_attribute(owner, name)
        setattr(owner, name, drifted(target))
        try:
            before = _snapshots(owners)
            try:
                fixes.apply(fix_id)
            except fixes.DriftError as exc:
                assert f"{target.dotted} is not the code" in str(exc), exc
            else:
                raise AssertionError(f"{target.dotted} drifted and the fix was applied")
            _assert_same(owners, before, f"a refusal for {target.dotted}")
            assert not fix.applied and _requirements_applied(fix) == required_before, "left applied"
        finally:
            setattr(owner, name, original)
        print(f"{fix_id}: refused {target.dotted}")


def check_noop_on_unaffected_release(fix_id: str) -> None:
    """On a release measured unaffected: apply is a no-op that says so (action "not needed", "not affected" and
    the probe's evidence in its message), patches nothing, and leaves the fix and its requirements unapplied."""
    import fixes

    fix = _fix(fix_id)
    with fix.measurement_context():
        required_before = _requirements_applied(fix)
        owners = _target_owners(fix, missing_ok=True)
        before = _snapshots(owners)
        evidence = fix.probe().evidence
        [outcome] = fixes.apply(fix_id)
        assert outcome.action == "not needed" and not outcome.changed, outcome
        assert "not affected" in outcome.message and evidence in outcome.message, outcome
        _assert_same(owners, before, "a no-op apply")
        assert not fix.applied and _requirements_applied(fix) == required_before
        assert _actions(fixes.revert(fix_id)) == ["not applied"]
