"""The registry: every entry under ``fixes/entries/``, found by discovery.

Each subpackage ``fixes/entries/<id with _>/`` is one entry; its ``__init__.py`` defines ``FIX``, an
instance of a :class:`~fixes.fix.Fix` subclass, and imports nothing heavy at module level (no
torch, no DeepSpeed, no harness), so listing and probing entries stays cheap.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import pkgutil
import re
import warnings
from functools import cache

from . import entries as _entries_package
from . import fix as _fix_module
from .exceptions import DeepSpeedNotInstalledError, DriftError, FixbookError, FixbookWarning, UnknownFixError
from .fix import Fix, Outcome
from .versions import installed_deepspeed

logger = logging.getLogger("fixes")


_ID = re.compile(r"[a-z0-9][a-z0-9-]*")  # an entry's id: its package's name, with "-" for "_"


def _load(name: str) -> Fix:
    """The ``FIX`` of the entry package ``fixes/entries/<name>/``, checked (it defines one, named after it)."""
    module = importlib.import_module(f"{_entries_package.__name__}.{name}")
    fix = getattr(module, "FIX", None)
    if not isinstance(fix, Fix):
        raise FixbookError(f"fixes/entries/{name}/__init__.py defines no FIX")
    if fix.id.replace("-", "_") != name:
        raise FixbookError(f"fixes/entries/{name}/ defines FIX with id {fix.id!r}; "
                           f"the package must be named after the id")
    return fix


@cache
def _entries() -> dict[str, Fix]:
    found: dict[str, Fix] = {}
    for module_info in pkgutil.iter_modules(_entries_package.__path__):
        if not module_info.ispkg or module_info.name.startswith("_"):
            continue
        fix = _load(module_info.name)
        found[fix.id] = fix
    return dict(sorted(found.items()))


def available() -> list[str]:
    """The ids of every registered fix, sorted."""
    return list(_entries())


def get(fix_id: str) -> Fix:
    """The fix registered under ``fix_id``; raises UnknownFixError listing the known ids. Imports that entry alone
    (its package, ``fixes/entries/<id with _>/``), not every entry: a rank that applies the fixes its launcher named
    reads only theirs. An id that names no entry package is looked up among every entry."""
    if isinstance(fix_id, str) and _ID.fullmatch(fix_id):
        name = fix_id.replace("-", "_")
        spec = importlib.util.find_spec(f"{_entries_package.__name__}.{name}")
        if spec is not None and spec.submodule_search_locations is not None:
            return _load(name)
    try:
        return _entries()[fix_id]
    except (KeyError, TypeError):
        raise UnknownFixError(fix_id, available()) from None


def all_fixes() -> list[Fix]:
    return list(_entries().values())


def apply(*fix_ids: str, strict: bool = False) -> list[Outcome]:
    """Apply the named fixes, or with no ids every fix whose probe finds its bug installed.

    Named fixes are all or nothing: every id is checked first, and if one fix fails (drift, a probe
    or a patch that raises), the fixes this call applied are reverted before the error propagates,
    so a failed call changes nothing.

    With no ids, every needed fix that can be applied is applied, and a fix that cannot (its probe
    raises, its target drifted, patching fails) is skipped: its outcome says ``refused`` (drift) or
    ``failed`` and why, and a :class:`~fixes.exceptions.FixbookWarning` names it. A job is never left
    with fewer fixes than could be applied. ``strict=True`` restores all-or-nothing for this form.
    Without DeepSpeed it raises :class:`~fixes.exceptions.DeepSpeedNotInstalledError`.

    With no ids (strict or not), an entry of kind "behaviour change" (``FixInfo.kind``) is never applied:
    it is an intended upstream change, not a bug, and pinning the old behaviour behind the user's back
    would override it. Where the installed DeepSpeed has the change, its outcome says ``skipped`` and
    how to pin the old behaviour (by naming it: ``fixes.apply("<id>")``).

    Which of the release's known bugs a job actually triggers depends on its configuration: ``fixes.check(engine)``
    after ``deepspeed.initialize`` says, and names the fix line of each.
    """
    if fix_ids or strict:
        skipped: list[Outcome] = []
        if fix_ids:
            fixes = [get(fix_id) for fix_id in fix_ids]
        else:
            fixes = []
            for fix in all_fixes():
                if not fix.is_affected():
                    continue
                if _is_behaviour_change(fix):
                    skipped.append(_skipped(fix, installed_deepspeed()))
                else:
                    fixes.append(fix)
        outcomes: list[Outcome] = []
        try:
            for fix in fixes:
                outcomes.append(fix.apply())
        except Exception:
            for fix, outcome in zip(fixes, outcomes):
                if outcome.action == "applied":
                    fix.revert()
            raise
        return outcomes + skipped
    release = installed_deepspeed()
    if release is None:
        raise DeepSpeedNotInstalledError("DeepSpeed is not installed in this environment: nothing to probe or fix")
    at_start = {fix.id: _affected_or_none(fix) for fix in all_fixes()}
    outcomes = []
    for fix in all_fixes():
        try:
            if fix.applied:
                outcomes.append(Outcome(fix.id, "already applied", "applied before this fix came up (by an "
                                        "earlier call, or as a fix another one requires)", release))
                continue
            if not fix.is_affected():
                if at_start[fix.id]:  # its code was replaced by a fix this call applied before it
                    outcomes.append(Outcome(fix.id, "not needed", "its bug was in the installed code when this call "
                                            "began and is gone now: a fix applied before it in this call replaced "
                                            "the same code; nothing was patched", release))
                continue
            if _is_behaviour_change(fix):
                outcomes.append(_skipped(fix, release))
                continue
            outcomes.append(fix.apply())
        except Exception as exc:  # noqa: BLE001 - one fix's failure must not cost the others
            action = "refused" if isinstance(exc, DriftError) else "failed"
            outcome = Outcome(fix.id, action, f"{type(exc).__name__}: {exc}", release)  # type: ignore[arg-type]
            warnings.warn(f"fixes.apply(): {fix.id} was not applied ({action}): {exc}", FixbookWarning, stacklevel=2)
            logger.warning("%s", outcome)
            outcomes.append(outcome)
    return outcomes


def _affected_or_none(fix: Fix) -> bool | None:
    """Whether ``fix``'s bug is in the installed code now (False where the fix is applied; None where its probe
    raises: ``apply()`` reports that when the fix comes up)."""
    try:
        return not fix.applied and fix.is_affected()
    except Exception:  # noqa: BLE001 - reported by the apply loop, in its turn
        return None


def _is_behaviour_change(fix: Fix) -> bool:
    return fix.info.kind == "behaviour change"


def _skipped(fix: Fix, release: str | None) -> Outcome:
    """The outcome of a behaviour change that ``apply()`` with no ids leaves alone."""
    outcome = Outcome(fix.id, "skipped", f"DeepSpeed {release} has this behaviour change ({fix.info.title}); it is "
                      "an intended upstream change, not a bug, so fixes.apply() leaves it alone. To pin the old "
                      f"behaviour, name it: fixes.apply({fix.id!r})", release)
    logger.info("%s", outcome)
    return outcome


def revert(*fix_ids: str) -> list[Outcome]:
    """Revert the named fixes, or with no ids every applied fix, the last applied first (two fixes that patch
    the same DeepSpeed object come off in the reverse of the order they went on). The outcomes are in the order
    of ``fix_ids`` (with no ids: of the reverts)."""
    fixes = [get(fix_id) for fix_id in fix_ids] if fix_ids else _fix_module.applied_fixes()
    done = {fix.id: fix.revert() for fix in sorted(fixes, key=lambda fix: fix.applied_order, reverse=True)}
    return [done[fix.id] for fix in fixes] if fix_ids else list(done.values())


_fix_module._lookup = get  # fix.py resolves a fix's ``requires`` through the registry
