"""Finding a fix's target in DeepSpeed, checking it is the code the fix was written for, and
swapping attributes in a way that can be put back exactly.

A target is fingerprinted by its normalised source tokens (:mod:`fixes.fingerprints`): the same
DeepSpeed source gives the same fingerprint on every Python version, and any edit to the code gives
a different one. Which fingerprints a fix accepts is recorded, not typed
(``fixes/data/fingerprints.json``, written by ``python -m ci.sweep.fingerprints``).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import linecache
import textwrap
from dataclasses import dataclass
from typing import Any, Mapping

from .exceptions import DeepSpeedNotInstalledError, DriftError
from .fingerprints import fingerprint, fingerprint_source  # noqa: F401 - fingerprint is re-exported

MISSING: Any = type("MISSING", (), {"__repr__": lambda self: "<missing>"})()

def stored_attribute(owner: Any, name: str) -> Any:
    """``owner.name`` as stored, or MISSING. On a class this reads the class's own ``__dict__``:
    a staticmethod stays a staticmethod, and an inherited attribute counts as missing, so that
    reverting deletes what a patch added instead of copying the parent's value onto the class."""
    return vars(owner).get(name, MISSING) if isinstance(owner, type) else getattr(owner, name, MISSING)


def import_target_module(module: str) -> Any:
    """Import a DeepSpeed module, turning a missing DeepSpeed into a clear error."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == "deepspeed":
            raise DeepSpeedNotInstalledError(
                f"cannot import {module}: DeepSpeed is not installed in this environment") from exc
        raise


@dataclass(frozen=True)
class Target:
    """One piece of DeepSpeed code a fix depends on, e.g. ``LinearFunctionForZeroStage3.forward``.

    The fingerprints it may have are not part of the target: they are recorded per fix (see
    :meth:`fixes.fix.Fix.known_fingerprints`) and handed to :meth:`check`.
    """

    module: str
    qualname: str

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"

    def owner_and_name(self) -> tuple[Any, str]:
        """The object holding the target and the attribute name (raises DriftError if absent)."""
        owner = import_target_module(self.module)
        *parents, name = self.qualname.split(".")
        for part in parents:
            try:
                owner = getattr(owner, part)
            except AttributeError:
                raise DriftError(f"{self.dotted}: {part!r} does not exist in the installed {self.module} "
                                 "(not yet added, renamed or removed)") from None
        return owner, name

    def raw(self) -> Any:
        """The attribute as stored on its owner (a staticmethod stays a staticmethod)."""
        owner, name = self.owner_and_name()
        stored = stored_attribute(owner, name)
        if stored is MISSING:
            raise DriftError(f"{self.dotted} does not exist in the installed DeepSpeed (not yet added, renamed or removed)")
        return stored

    def replace(self, new: Any) -> "AttributePatch":
        """A patch (not yet applied) that puts ``new`` where the target is stored."""
        owner, name = self.owner_and_name()
        return AttributePatch(owner, name, new)

    def wrap(self, make: Any) -> "AttributePatch":
        """A patch (not yet applied) that replaces the target with ``make(original)``, the original
        as stored (a staticmethod stays one): the target is named once, here."""
        return self.replace(make(self.raw()))

    def code(self) -> Any:
        """The function whose source is fingerprinted (a staticmethod's function, unwrapped)."""
        raw = self.raw()
        if isinstance(raw, (staticmethod, classmethod)):
            raw = raw.__func__
        return inspect.unwrap(raw)

    def source(self) -> str:
        return inspect.getsource(self.code())

    def current_fingerprint(self) -> str:
        return fingerprint_source(self.source())

    def check(self, known: Mapping[str, tuple[str, ...]]) -> None:
        """Raise DriftError unless the installed code is one the fix was written for: ``known`` maps
        each accepted fingerprint to the releases that ship it."""
        found = self.current_fingerprint()
        if found not in known:
            listed = "; ".join(f"{fp} ({', '.join(releases)})" for fp, releases in known.items()) or "none"
            raise DriftError(f"{self.dotted} is not the code this fix was written for: its fingerprint is "
                             f"{found}, the fix knows {listed}. Nothing was patched. If this DeepSpeed "
                             f"still shows the bug, the fix needs updating for it.")


def edited_source(function: Any, old: str, new: str, dotted: str) -> str:
    """``function``'s installed source with the text ``old`` replaced by ``new``; DriftError (nothing patched)
    unless ``old`` occurs exactly once."""
    source = inspect.getsource(function)
    found = source.count(old)
    if found != 1:
        raise DriftError(f"{dotted}: expected this once in its source, found it {found} times. Nothing was "
                         f"patched:\n{old}")
    return source.replace(old, new)


def recompiled(original: Any, source: str, label: str) -> Any:
    """A module-level function compiled again from ``source`` (its own source, edited: see :func:`edited_source`)
    in its module's globals, at the installed file's line numbers and under a file name of its own whose text is
    registered with ``linecache``, so tracebacks and ``inspect.getsource(function.__code__)`` show the code that runs. Name, qualname,
    docstring, defaults and keyword defaults are the original's; ``__wrapped__`` is the original (drift checks read
    the installed code through it). ``label`` names the fix in the file name."""
    _, first = inspect.getsourcelines(original)
    text = "\n" * (first - 1) + textwrap.dedent(source)
    # one name per text: applying again reuses its linecache entry
    filename = f"<fixes {label}: {inspect.getsourcefile(original)} {hashlib.sha256(text.encode()).hexdigest()[:12]}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(text, filename, "exec"), vars(import_target_module(original.__module__)), namespace)  # noqa: S102
    function = namespace[original.__name__]
    function.__qualname__, function.__doc__ = original.__qualname__, original.__doc__
    function.__defaults__, function.__kwdefaults__ = original.__defaults__, original.__kwdefaults__
    function.__wrapped__ = original
    return function


def undecorated(function: Any) -> Any:
    """The code under its wrappers: ``functools.wraps``-style ``__wrapped__`` chains (the Fixbook's own
    patches set it too), and DeepSpeed's ``@instrument_w_nvtx``, which wraps without ``functools.wraps``:
    its ``wrapped_fn`` keeps the decorated function in its closure as ``func``. Anything else is
    returned as is."""
    while True:
        function = inspect.unwrap(function)
        code = getattr(function, "__code__", None)
        if getattr(function, "__name__", "") == "wrapped_fn" and code is not None and "func" in code.co_freevars:
            inner = function.__closure__[code.co_freevars.index("func")].cell_contents
            if inspect.isfunction(inner):
                function = inner
                continue
        return function


@dataclass(frozen=True)
class DecoratedTarget(Target):
    """A target decorated with ``@instrument_w_nvtx``, fingerprinted by the decorated method's own
    source: the wrapper's source is the same for every method and release, so a plain
    :class:`Target` would not notice any change to the method."""

    def code(self) -> Any:
        return undecorated(self.raw())


@dataclass
class AttributePatch:
    """Sets ``owner.name = new`` and remembers what was there (or that nothing was) to put it back."""

    owner: Any
    name: str
    new: Any
    original: Any = MISSING
    active: bool = False

    def apply(self) -> None:
        if self.active:
            return
        self.original = stored_attribute(self.owner, self.name)
        setattr(self.owner, self.name, self.new)
        self.active = True

    def revert(self) -> None:
        if not self.active:
            return
        if self.original is MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.original)
        self.active = False
