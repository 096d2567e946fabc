"""The registry: every fix module in the ``fixes`` package, found by discovery.

A module of this package is an entry unless it is one of the framework modules below; each entry
module defines ``FIX``, an instance of a :class:`~fixes.fix.Fix` subclass, and imports nothing
heavy at module level (no torch, no DeepSpeed), so listing entries stays cheap.
"""
from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from .exceptions import FixbookError, UnknownFixError
from .fix import Fix, Outcome

FRAMEWORK_MODULES = frozenset({"cli", "exceptions", "fix", "harness", "measured", "patching", "registry", "versions"})


@cache
def _entries() -> dict[str, Fix]:
    package = importlib.import_module(__package__)
    found: dict[str, Fix] = {}
    for module_info in pkgutil.iter_modules(package.__path__):
        if module_info.name in FRAMEWORK_MODULES or module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{module_info.name}")
        fix = getattr(module, "FIX", None)
        if not isinstance(fix, Fix):
            raise FixbookError(f"fixes/{module_info.name}.py is not a framework module and defines no FIX")
        if fix.id.replace("-", "_") != module_info.name:
            raise FixbookError(f"fixes/{module_info.name}.py defines FIX with id {fix.id!r}; "
                               f"the module must be named after the id")
        found[fix.id] = fix
    return dict(sorted(found.items()))


def available() -> list[str]:
    """The ids of every registered fix, sorted."""
    return list(_entries())


def get(fix_id: str) -> Fix:
    """The fix registered under ``fix_id``; raises UnknownFixError listing the known ids."""
    try:
        return _entries()[fix_id]
    except KeyError:
        raise UnknownFixError(fix_id, available()) from None


def all_fixes() -> list[Fix]:
    return list(_entries().values())


def apply(*fix_ids: str) -> list[Outcome]:
    """Apply the named fixes, or with no ids every fix whose probe finds its bug installed.

    All ids are checked before anything is patched. If one fix fails (drift), the fixes this call
    already applied are reverted before the error propagates, so a failed call changes nothing.
    """
    fixes = [get(fix_id) for fix_id in fix_ids] if fix_ids else [f for f in all_fixes() if f.is_affected()]
    outcomes: list[Outcome] = []
    try:
        for fix in fixes:
            outcomes.append(fix.apply())
    except Exception:
        for fix, outcome in zip(fixes, outcomes):
            if outcome.action == "applied":
                fix.revert()
        raise
    return outcomes


def revert(*fix_ids: str) -> list[Outcome]:
    """Revert the named fixes, or with no ids every applied fix."""
    fixes = [get(fix_id) for fix_id in fix_ids] if fix_ids else [f for f in all_fixes() if f.applied]
    return [fix.revert() for fix in fixes]
