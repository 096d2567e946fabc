"""Fix for zero3-overwrites-module-id: the backport of upstream PR #6847, which keeps ZeRO-3's own module number
in ``module.ds_id`` instead of ``module.id``.

ZeRO-3 numbers every module of the model when it registers its hooks
(``DeepSpeedZeRoOffload._register_hooks_recursively``, ``deepspeed/runtime/zero/parameter_offload.py``) and
reads that number back as the module's key wherever it traces, fetches and releases parameters: in
``PartitionedParameterCoordinator`` (``partitioned_param_coordinator.py``: ``trace_prologue``,
``record_module``, ``record_parameters``, ``reset_step``, ``fetch_sub_module``, ``release_sub_module``) and in
``DeepSpeedZeRoOffload.post_sub_module_forward_function`` / ``post_sub_module_backward_function`` (their log
lines, formatted on every call). Every one of those accesses is spelled ``<module>.id``: the writer and the
nine readers are all the places either file names ``.id`` (the patch refuses with ``DriftError`` otherwise).

A reader cannot tell DeepSpeed's number from the user's value of the same attribute, so no wrapper can separate
them: the fix replaces each of the nine methods with the installed release's own source, recompiled with
``.id`` renamed to ``.ds_id``, which is upstream's change, token for token (upstream's diff renames exactly these
accesses; ``_register_hooks_recursively`` is renamed ``_register_deepspeed_module`` there too, which the
backport does not do). Each method is compiled in its module's globals, inside a class statement of its class's
name so that ``self.__x`` is name-mangled as in the original, with the ``__class__`` cell pointed at the real
class, the original's default values (``_register_hooks_recursively``'s shared ``count=[0]``) and decorators
(``@compiler.disable``, ``@instrument_w_nvtx``, ``@torch.no_grad()``), under a file name whose text is
registered with ``linecache`` at the original line numbers. The drift check (recorded fingerprints) guarantees
that the source is one the fix was verified on. ``__wrapped__`` of each replacement is the installed original,
so another fix's drift check of the same method (``zero3-hooks-attribute-delegating-modules`` checks
``_register_hooks_recursively``) still sees the installed code, and another fix may wrap a replacement. The other
way round, where another fix has already put its own function in one of these places, the patch refuses
(``DriftError``: apply this fix first) rather than drop that fix by recompiling the installed source over it.

Apply it **before** ``deepspeed.initialize``: modules registered without it hold DeepSpeed's number in
``module.id`` (the user's value is already gone) and no ``ds_id``, which the replaced readers need. Likewise a
ZeRO-3 engine built with the fix applied needs it while it trains: revert only when no such engine is in use.
``deepspeed.utils.debug.debug_module2name_id`` still formats ``module.id``, as it does after upstream's fix; no
code calls it (``PartitionedParameterCoordinator._dump_params`` is never called).

The probe reads the registration method: affected where it assigns ``module.id``.
"""
from __future__ import annotations

import hashlib
import inspect
import linecache
import re
from pathlib import Path
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, DecoratedTarget, Target, import_target_module, undecorated

_OFFLOAD_MODULE = "deepspeed.runtime.zero.parameter_offload"
_COORDINATOR_MODULE = "deepspeed.runtime.zero.partitioned_param_coordinator"
_OFFLOAD = "DeepSpeedZeRoOffload"
_COORDINATOR = "PartitionedParameterCoordinator"
# The writer: numbers every module, `module.id = my_count`
_REGISTER = DecoratedTarget(_OFFLOAD_MODULE, f"{_OFFLOAD}._register_hooks_recursively")
# The readers: every other method of the two modules that names `.id` (a module's number, as a key or in a log line)
_READERS = (tuple(DecoratedTarget(_OFFLOAD_MODULE, f"{_OFFLOAD}.{name}") for name in (
    "post_sub_module_forward_function", "post_sub_module_backward_function")) +
    tuple(DecoratedTarget(_COORDINATOR_MODULE, f"{_COORDINATOR}.{name}") for name in (
        "trace_prologue", "record_module", "record_parameters", "reset_step", "fetch_sub_module",
        "release_sub_module")))
TARGETS: tuple[Target, ...] = (_REGISTER, *_READERS)
# The two registration methods by name (renamed by upstream's fix); a release has one of them
_REGISTRATION_NAMES = ("_register_hooks_recursively", "_register_deepspeed_module")
MODULE_ID = re.compile(r"\.id\b")  # `.id`, not `.ds_id`, `.identity` or `.id_`
_ASSIGNS_ID = re.compile(r"\bmodule\.id\s*=[^=]")
_ASSIGNS_DS_ID = re.compile(r"\bmodule\.ds_id\s*=[^=]")
_FILENAME = "<fixes zero3-overwrites-module-id: {} {}>"
_FIXES_DIR = Path(__file__).resolve().parents[2]  # the `fixes` package: where another fix's replacement lives


class Zero3OverwritesModuleId(Fix):
    targets = TARGETS

    def read_code(self) -> Probe:
        offload = getattr(import_target_module(_OFFLOAD_MODULE), _OFFLOAD)
        name = next((name for name in _REGISTRATION_NAMES if name in vars(offload)), None)
        if name is None:
            return Probe(False, f"{_OFFLOAD} has neither registration method this fix knows")
        source = inspect.getsource(vars(offload)[name])
        if _ASSIGNS_ID.search(source):
            return Probe(True, f"{_OFFLOAD}.{name} assigns module.id = my_count: ZeRO-3's module number replaces "
                               "the module's own id attribute")
        if _ASSIGNS_DS_ID.search(source):
            return Probe(False, f"{_OFFLOAD}.{name} numbers modules in module.ds_id (upstream PR #6847)")
        return Probe(False, f"{_OFFLOAD}.{name} assigns neither module.id nor module.ds_id")

    def patches(self) -> list[AttributePatch]:
        _check_no_other_readers()
        for target in TARGETS:
            _check_not_patched_by_another_fix(target)
        return [target.replace(renamed(target)) for target in TARGETS]


def _check_no_other_readers() -> None:
    """Raise DriftError if either module names ``.id`` anywhere but in :data:`TARGETS`: a reader the fix does
    not rename would look for DeepSpeed's number in the user's attribute."""
    for module_name in (_OFFLOAD_MODULE, _COORDINATOR_MODULE):
        module = import_target_module(module_name)
        total = len(MODULE_ID.findall(inspect.getsource(module)))
        covered = sum(len(MODULE_ID.findall(inspect.getsource(target.code())))
                      for target in TARGETS if target.module == module_name)
        if total != covered:
            raise DriftError(f"{module_name} names `.id` {total} times, the methods this fix renames "
                             f"{covered} times: some code the fix does not cover reads or writes module.id. "
                             "Nothing was patched.")


def _check_not_patched_by_another_fix(target: Target) -> None:
    """Raise DriftError where another fix has put its own function in ``target``'s place (its drift check passes
    through its ``__wrapped__``): recompiling the installed source there would silently drop that fix. Applied
    first, this fix leaves its replacement for another fix to wrap."""
    code = getattr(target.raw(), "__code__", None)
    if code is None:
        return
    filename = code.co_filename
    if filename.startswith("<fixes") or Path(filename).resolve().is_relative_to(_FIXES_DIR):
        raise DriftError(f"{target.dotted} is already replaced by another fix's code ({filename}): apply "
                         f"{FIX.id} before that fix. Nothing was patched.")


def renamed(target: Target) -> Any:
    """``target`` (a method of a class at module level, as installed) recompiled from its own source with every
    ``.id`` renamed ``.ds_id``: the same decorators, defaults, name mangling and ``__class__``; ``__wrapped__``
    is the installed method. Raises DriftError where the method names no ``.id`` or is not indented as a method
    of a module-level class."""
    owner, name = target.owner_and_name()
    original = target.raw()
    function = target.code()  # under its decorators
    lines, first = inspect.getsourcelines(function)
    source = "".join(lines)
    if not MODULE_ID.search(source):
        raise DriftError(f"{target.dotted} names no `.id`: nothing to rename. Nothing was patched.")
    if not lines[0].startswith("    ") or lines[0].startswith("     ") or first < 2:
        raise DriftError(f"{target.dotted} is not a method of a module-level class. Nothing was patched.")
    # the class statement on the line before the method, the method at its own line numbers: `self.__x` is
    # mangled with the class's name, and tracebacks point at the lines a reader finds in the installed file
    text = "\n" * (first - 2) + f"class {owner.__name__}:\n" + MODULE_ID.sub(".ds_id", source)
    filename = _FILENAME.format(inspect.getsourcefile(function), hashlib.sha256(text.encode()).hexdigest()[:12])
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    module = import_target_module(target.module)
    exec(compile(text, filename, "exec"), vars(module), namespace)  # noqa: S102
    replacement = vars(namespace[owner.__name__])[name]
    inner = undecorated(replacement)
    inner.__defaults__ = function.__defaults__  # the same default objects (the shared `count=[0]`)
    inner.__kwdefaults__ = function.__kwdefaults__
    if "__class__" in inner.__code__.co_freevars:  # `__class__.X` in the body: the real class, not the stand-in
        inner.__closure__[inner.__code__.co_freevars.index("__class__")].cell_contents = owner
    replacement.__wrapped__ = original
    return replacement


def renamed_lines(target: Target) -> list[tuple[int, str, str]]:
    """``(line number, installed line, the line as the fix compiles it)`` for every line of ``target``'s installed
    source that names ``.id``."""
    lines, first = inspect.getsourcelines(target.code())
    return [(number, line.rstrip(), MODULE_ID.sub(".ds_id", line).rstrip())
            for number, line in enumerate(lines, first) if MODULE_ID.search(line)]


FIX = Zero3OverwritesModuleId()
