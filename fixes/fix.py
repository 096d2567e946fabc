"""What one knowledge-base entry's fix is: its metadata (:class:`FixInfo`) and its behaviour
(:class:`Fix`: probe, drift check, apply, revert).

Contract of every fix:

* ``probe()`` looks at the installed DeepSpeed's code (not only its version) and says whether the
  bug is there.
* ``apply()`` is idempotent. On an unaffected DeepSpeed it patches nothing and says why. On an
  affected one it first checks every :class:`~fixes.patching.Target` against the fingerprints the
  fix was written for and raises :class:`~fixes.exceptions.DriftError` *before touching anything*
  if one differs.
* ``revert()`` puts back the exact original objects (identity, not a copy) and is idempotent.
"""
from __future__ import annotations

import abc
import contextlib
import importlib
import itertools
import logging
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Literal

from . import fingerprints
from .exceptions import DriftError, PatchError
from .files import INFO_FILE
from .patching import AttributePatch, Target, stored_attribute
from .versions import installed_deepspeed, parse

if TYPE_CHECKING:
    from .trigger import Trigger
    from .measured import EntrySweep

logger = logging.getLogger("fixes")

Symptom = Literal["crash", "silent wrong result", "hang"]
# What an entry is: a bug, or a deliberate upstream change of behaviour (e.g. a new default) that changes
# results silently for configs that relied on the old one. ``fixes.apply()`` with no ids applies bugs'
# fixes only; a behaviour change's "fix" pins the old behaviour and is applied only when named.
Kind = Literal["bug", "behaviour change"]
KINDS: tuple[str, ...] = ("bug", "behaviour change")
UPSTREAM = "https://github.com/deepspeedai/DeepSpeed"


def _read_toml(path: Path) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - CPython 3.9/3.10 (the package depends on tomli there)
        import tomli as tomllib
    with path.open("rb") as handle:
        return tomllib.load(handle)


@dataclass(frozen=True)
class FixInfo:
    """Everything the site, the CLI and the runner need to know about one bug.

    Which releases are affected is *measured*, not stated here: :attr:`sweep` reads it from the
    release sweep (``fixes/data/sweep.json``, written by ``python -m ci.sweep``). What upstream says
    (``upstream_introduced``, ``upstream_fixed_in``) is kept apart, to be checked against it.
    """

    id: str
    title: str
    summary: str
    symptom: Symptom
    components: tuple[str, ...]
    error_signatures: tuple[str, ...]
    root_cause: str
    reproduce_release: str
    upstream_fixed_in: str | None = None  # the release upstream says fixed it (None: open upstream)
    upstream_introduced: str | None = None  # the first release upstream says had it, if stated
    upstream_issues: tuple[int, ...] = ()
    upstream_prs: tuple[int, ...] = ()
    upstream_note: str = ""
    measured_under: str = ""  # a condition the sweep selects to measure the bug (see Fix.measurement_context)
    reproduced_here: bool = True
    # "behaviour change": not a bug but an intended upstream change; "affected" means "has the new
    # behaviour", the fix pins the old one, and fixes.apply() with no ids leaves it alone.
    kind: Kind = "bug"
    # other entries with the same cause or the same symptom (ids); the card shows the link from both ends
    related: tuple[str, ...] = ()
    # how the Fixbook itself found the bug, where it was not taken from an upstream report (e.g. the differential
    # sweep's cells that showed it); the card says so
    found_by: str = ""

    @classmethod
    def read(cls, path: Path) -> "FixInfo":
        """The metadata an entry states in ``path`` (its ``info.toml``): every field of this class by name, lists
        for the tuples. An unknown or missing field, or a file that does not parse, raises ``ValueError`` naming
        the file."""
        try:
            data = _read_toml(path)
        except ValueError as exc:  # tomllib.TOMLDecodeError
            raise ValueError(f"{path}: not valid TOML: {exc}") from exc
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}; FixInfo has {', '.join(known)}")
        values = {name: tuple(value) if isinstance(value, list) else value for name, value in data.items()}
        try:
            return cls(**values)
        except TypeError as exc:
            raise ValueError(f"{path}: {exc}") from exc

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.id}: unknown kind {self.kind!r}; use one of {KINDS}")
        for release in [self.reproduce_release, self.upstream_fixed_in, self.upstream_introduced]:
            if release is not None:
                parse(release)  # reject typos in metadata at import time

    @property
    def sweep(self) -> "EntrySweep":
        """This entry's measured observations on every swept release."""
        from .measured import for_entry

        return for_entry(self.id)

    @property
    def measured(self) -> dict[str, bool]:
        """{release: affected} for every release the sweep answered decisively."""
        return {r: o.affected for r, o in self.sweep.observations.items() if o.affected is not None}

    @property
    def fixed_in(self) -> str | None:
        """The first release measured fixed (after the last affected one); None while still affected."""
        return self.sweep.first_fixed

    @property
    def affected_releases(self) -> list[str]:
        return self.sweep.affected

    @property
    def unaffected_releases(self) -> list[str]:
        return self.sweep.unaffected

    def expected_affected(self, release: str) -> bool | None:
        """Whether ``release`` was measured affected; None if it was not swept (or not decisively)."""
        return self.sweep.expected_affected(release)

    @property
    def upstream_disagreement(self) -> str | None:
        """How the measured range differs from what upstream states, or None where they agree (or
        upstream states nothing to compare). An introduction upstream places before the oldest release measured
        agrees with a range that starts there: the sweep cannot see further back."""
        sweep = self.sweep
        if not sweep.observations:
            return None
        differences = []
        if self.upstream_fixed_in and sweep.first_fixed != self.upstream_fixed_in:
            still = [r for r in sweep.affected if parse(r) >= parse(self.upstream_fixed_in)]
            measured = (f"still affected on {', '.join(still)}" if still else
                        f"the first release measured fixed is {sweep.first_fixed or 'none'}")
            differences.append(f"upstream says fixed in {self.upstream_fixed_in}; {measured}")
        older_than_measured = (sweep.starts_at_oldest and self.upstream_introduced is not None
                               and parse(self.upstream_introduced) <= parse(sweep.releases[0]))
        if self.upstream_introduced and sweep.first_affected != self.upstream_introduced and not older_than_measured:
            differences.append(f"upstream says introduced in {self.upstream_introduced}; the first release "
                               f"measured affected is {sweep.first_affected or 'none'}")
        return "; ".join(differences) or None

    @property
    def links(self) -> list[tuple[str, str]]:
        return ([(f"issue #{n}", f"{UPSTREAM}/issues/{n}") for n in self.upstream_issues] +
                [(f"PR #{n}", f"{UPSTREAM}/pull/{n}") for n in self.upstream_prs])

    @property
    def apply_call(self) -> str:
        return f'import fixes; fixes.apply("{self.id}")'

    @property
    def is_behaviour_change(self) -> bool:
        return self.kind == "behaviour change"

    @property
    def label(self) -> str:
        """What the card and the lists call it: the symptom of a bug; "behaviour change" otherwise."""
        return "behaviour change" if self.is_behaviour_change else self.symptom


@dataclass(frozen=True)
class Probe:
    """The answer of a fix's probe: is the bug in the installed code, and the evidence."""

    affected: bool
    evidence: str


@dataclass(frozen=True)
class Outcome:
    """What ``apply()``/``revert()`` did."""

    fix_id: str
    # "skipped": fixes.apply() with no ids leaves a behaviour change alone (it applies only when named)
    action: Literal["applied", "already applied", "not needed", "reverted", "not applied", "skipped", "refused",
                    "failed"]
    message: str
    deepspeed: str | None = None

    @property
    def changed(self) -> bool:
        return self.action in ("applied", "reverted")

    def __str__(self) -> str:
        return f"[{self.fix_id}] {self.action}: {self.message}"


class Fix(abc.ABC):
    """Base class of every fix. A subclass sets ``info`` and ``targets`` and implements
    ``read_code()`` and ``patches()``; the base class owns the probe of its own patches and the
    apply/revert protocol."""

    info: ClassVar[FixInfo]
    targets: ClassVar[tuple[Target, ...]]
    # Fixes this one needs on releases that have their bug too. apply() applies them first (each is
    # a no-op where its bug is absent); revert() reverts those that this apply() turned on, and
    # leaves alone any that were already applied.
    requires: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """An entry's class takes its ``info`` from the ``info.toml`` beside its module, unless it sets one."""
        super().__init_subclass__(**kwargs)
        if "info" in cls.__dict__:
            return
        module = sys.modules.get(cls.__module__)
        path = Path(getattr(module, "__file__", None) or ".").with_name(INFO_FILE)
        if path.is_file():
            cls.info = FixInfo.read(path)

    def __init__(self) -> None:
        self._active: list[AttributePatch] = []
        self._applied_requirements: list[Fix] = []
        self.applied_order = 0  # when apply() last patched something, in this process's order of applies (0: never)

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def trigger(self) -> "Trigger | None":
        """The jobs that hit this bug (``fixes/entries/<id>/trigger.py``'s ``TRIGGER``), or None where the entry
        states none. Loaded on first use: listing and probing entries never import it."""
        import importlib

        package = type(self).__module__
        try:
            module = importlib.import_module(f"{package}.trigger")
        except ModuleNotFoundError as exc:
            if exc.name == f"{package}.trigger":
                return None
            raise
        return module.TRIGGER

    def probe(self) -> Probe:
        """Whether the bug is in this process's DeepSpeed: not while this fix is applied here (the
        framework knows its own patches; no marker on the replacement is needed), else what
        :meth:`read_code` finds in the installed code."""
        if self._active:
            patched = ", ".join(dict.fromkeys(_dotted(patch) for patch in self._active))
            return Probe(False, f"fixed in this process: fixes.apply({self.id!r}) patched {patched}")
        return self.read_code()

    @abc.abstractmethod
    def read_code(self) -> Probe:
        """Read the installed DeepSpeed's code (never this fix's patches: :meth:`probe` answers for
        those) and say whether this bug is in it, with the evidence."""

    @abc.abstractmethod
    def patches(self) -> list[AttributePatch]:
        """The attribute swaps that fix the bug (built, not yet applied). Called after the drift check."""

    def reproduce(self) -> bool | None:
        """The entry's fast behavioural check, for the release sweep (``python -m ci.sweep``): run the
        reproduce step on the installed DeepSpeed in this process (after ``harness.setup()``; it may
        launch ranks) in seconds, with no fix applied, and say whether the bug shows. It is the
        function ``reproduce()`` of the entry's ``reproduce.py`` (beside its ``__init__.py``); it raises
        :class:`~fixes.exceptions.CannotTellError` when the run fails in a way that says nothing about
        the bug. ``None``: the entry has no such module and the sweep relies on ``probe()`` alone."""
        module = self._reproduction()
        return None if module is None else module.reproduce()

    def measurement_context(self) -> ContextManager[None]:
        """The conditions the sweep measures this entry under (its probe and ``reproduce()`` run inside
        this context): the entry's ``reproduce.measurement_context()`` if it defines one, else the
        installed environment as it is. An entry whose bug needs a condition the Fixbook's machine
        lacks (an old torch) selects it there, and says so in ``FixInfo.measured_under``."""
        module = self._reproduction()
        context = getattr(module, "measurement_context", None)
        return context() if context is not None else contextlib.nullcontext()

    def _reproduction(self) -> Any:
        """The entry's ``reproduce`` module, or None where it has none."""
        package = type(self).__module__
        try:
            return importlib.import_module(f"{package}.reproduce")
        except ModuleNotFoundError as exc:
            if exc.name == f"{package}.reproduce":
                return None
            raise

    def is_affected(self) -> bool:
        return self.probe().affected

    @property
    def applied(self) -> bool:
        return bool(self._active) or bool(self._applied_requirements)

    def known_fingerprints(self, target: Target) -> dict[str, tuple[str, ...]]:
        """{fingerprint: releases} of ``target`` that this fix was written for, as recorded by
        ``python -m ci.sweep.fingerprints`` in ``fixes/data/fingerprints.json``."""
        return fingerprints.recorded(self.id).get(target.dotted, {})

    def check_targets(self) -> None:
        """Raise DriftError if any target is not the code this fix was written for."""
        for target in self.targets:
            target.check(self.known_fingerprints(target))

    def check_applicable(self) -> list["Fix"]:
        """Every drift check ``apply()`` makes, patching nothing: this fix's targets and those of each
        required fix whose bug is installed. Raises DriftError; returns the required fixes."""
        self.check_targets()
        required = [_resolve(fix_id) for fix_id in self.requires]
        for fix in required:
            if fix.is_affected():
                fix.check_targets()
        return required

    def apply(self) -> Outcome:
        """Patch the installed DeepSpeed if it has this bug (see the module docstring).

        Every drift check (this fix's and its requirements') runs before anything is patched. If
        applying a requirement or a patch fails, everything this call applied is undone and
        PatchError is raised: the process is left as it was.
        """
        release = installed_deepspeed()
        if self.applied:
            return self._outcome("already applied", "nothing to do; revert() undoes it", release)
        probe = self.probe()
        if not probe.affected:
            return self._outcome("not needed", f"DeepSpeed {release} is not affected ({probe.evidence}); "
                                 "nothing was patched", release)
        required = self.check_applicable()
        patches: list[AttributePatch] = []
        try:
            for fix in required:
                if fix.apply().action == "applied":
                    self._applied_requirements.append(fix)
            patches = self.patches()
            for patch in patches:
                patch.apply()
                self._active.append(patch)
        except Exception as exc:
            self._undo()
            if isinstance(exc, DriftError):  # a drift check inside patches(): still drift, now undone
                raise
            raise PatchError(f"{self.id}: applying failed and everything it applied was rolled back: "
                             f"{type(exc).__name__}: {exc}") from exc
        self.applied_order = next(_APPLY_ORDER)
        if not any(fix is self for fix in _APPLIED):
            _APPLIED.append(self)
        also = self._applied_requirements
        needed = f"; also applied {', '.join(f.id for f in also)}, which this fix needs" if also else ""
        patched = ", ".join(dict.fromkeys(_dotted(patch) for patch in patches))
        return self._outcome("applied", f"patched {patched} "
                             f"on DeepSpeed {release} ({probe.evidence}){needed}", release)

    def revert(self) -> Outcome:
        """Put back what apply() replaced. Refuses (PatchError, nothing reverted) where something was set over one
        of this fix's patches after it (a fix applied later on the same DeepSpeed object): putting the original
        back would drop that later patch, and reverting that one afterwards would bring this one back.
        ``fixes.revert()`` reverts in the reverse order of applying, so layered fixes come off cleanly."""
        release = installed_deepspeed()
        if not self.applied:
            return self._outcome("not applied", "nothing to revert", release)
        covered = [patch for patch in self._active if stored_attribute(patch.owner, patch.name) is not patch.new]
        if covered:
            raise PatchError(f"{self.id}: not reverted: {', '.join(dict.fromkeys(_dotted(p) for p in covered))} was "
                             "replaced again after this fix patched it (by a fix applied later, or other code); revert "
                             "that first, or call fixes.revert() with no ids, which reverts in the reverse order of "
                             "applying")
        self._undo()
        return self._outcome("reverted", "original DeepSpeed objects restored", release)

    def _undo(self) -> None:
        while self._active:
            self._active.pop().revert()
        while self._applied_requirements:
            self._applied_requirements.pop().revert()

    def _outcome(self, action: str, message: str, release: str | None) -> Outcome:
        outcome = Outcome(self.id, action, message, release)  # type: ignore[arg-type]
        logger.info("%s", outcome)
        return outcome


def _resolve(fix_id: str) -> "Fix":
    """The registered fix ``fix_id`` (a fix's ``requires``). The registry installs the lookup when it
    is imported, so this module does not import the registry (which imports this one)."""
    if _lookup is None:
        raise PatchError(f"cannot resolve required fix {fix_id!r}: the registry is not loaded")
    return _lookup(fix_id)


_lookup: "Callable[[str], Fix] | None" = None
_APPLY_ORDER = itertools.count(1)
_APPLIED: list["Fix"] = []  # every fix whose apply() patched something in this process, first applied first


def applied_fixes() -> list["Fix"]:
    """The fixes applied in this process now (``applied``), sorted by id: whichever way each was reached (the
    registry, its entry's module), without importing any other entry."""
    return sorted((fix for fix in _APPLIED if fix.applied), key=lambda fix: fix.id)


def _dotted(patch: AttributePatch) -> str:
    """``module.Class.attribute`` (or ``module.attribute``) of what a patch replaces."""
    owner = patch.owner
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{patch.name}"
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{patch.name}"
