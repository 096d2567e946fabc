"""Fix for zero3-allreduce-fetch-padded-params: the backport of upstream PR #8158, one line.

The buggy line lives in a function nested inside ``Init._convert_to_deepspeed_param``
(``deepspeed/runtime/zero/partition_parameters.py``): the all_reduce branch of the coalesced fetch, a
closure that ``_convert_to_deepspeed_param`` builds for every parameter and stores as
``param.all_gather_coalesced``. A nested function cannot be replaced from outside, so the fix replaces
``Init._convert_to_deepspeed_param`` itself with the installed release's own source, recompiled with the one
line upstream changed: ``start_param += param.ds_numel`` becomes ``start_param += param.ds_numel_aligned``.
Nothing else differs. The drift check (recorded fingerprints) guarantees that the source is one the fix was
verified on, and the rewrite refuses (``DriftError``) unless the line occurs exactly once. The new function is
compiled in the module's own globals, under a file name of its own whose text is registered with
``linecache`` at the original line numbers, so tracebacks and ``inspect.getsource`` show the code that runs.

``_convert_to_deepspeed_param`` runs once per parameter, when the model is partitioned (inside
``deepspeed.zero.Init``, or in ``deepspeed.initialize`` for a model built outside it). Apply the fix before
that: parameters partitioned earlier keep the fetch DeepSpeed built for them. Revert restores the original
function; parameters partitioned while the fix was applied keep the corrected fetch.
"""
from __future__ import annotations

import hashlib
import inspect
import linecache
import re
import textwrap
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module, undecorated

_MODULE = "deepspeed.runtime.zero.partition_parameters"
_TARGET = Target(_MODULE, "Init._convert_to_deepspeed_param")
_ALL_REDUCE_BRANCH = "self.use_all_reduce_for_fetch_params and not quantize"
# the stride of the all_reduce fetch: each parameter's slot is ds_numel_aligned wide, the walk steps ds_numel
_UNALIGNED_STRIDE = re.compile(r"^(?P<indent>[ \t]*)start_param \+= param\.ds_numel[ \t]*$", re.MULTILINE)
_ALIGNED_STRIDE = "start_param += param.ds_numel_aligned"
_FILENAME = "<fixes zero3-allreduce-fetch-padded-params: {} {}>"


class Zero3AllreduceFetchPaddedParams(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        init = getattr(import_target_module(_MODULE), "Init")
        source = inspect.getsource(vars(init)["_convert_to_deepspeed_param"])
        if _ALL_REDUCE_BRANCH not in source:
            return Probe(False, "Init._convert_to_deepspeed_param builds no all_reduce fetch "
                                "(stage3_use_all_reduce_for_fetch_params)")
        if _UNALIGNED_STRIDE.search(source):
            evidence = ("the all_reduce fetch built by Init._convert_to_deepspeed_param sizes its buffer by "
                        "ds_numel_aligned but advances start_param by ds_numel")
            if fetch_wait_raises():
                evidence += ("; on this release the fetch also raises TypeError in training "
                             "(AllReduceCoalescedHandle.wait() takes no handle_dependency, upstream PR #7414)")
            return Probe(True, evidence)
        return Probe(False, "the all_reduce fetch built by Init._convert_to_deepspeed_param advances start_param by "
                            "ds_numel_aligned")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.replace(realigned(_TARGET.raw()))]


def fetch_wait_raises() -> bool:
    """Whether ZeRO-3's parameter coordinator waits on fetch handles with ``wait(handle_dependency=...)`` while
    ``AllReduceCoalescedHandle.wait`` takes no such argument: then every training step with the all_reduce fetch
    raises ``TypeError`` at its first fetch, before any fetched value is used (fixed upstream by PR #7414)."""
    coordinator = import_target_module("deepspeed.runtime.zero.partitioned_param_coordinator")
    handle = getattr(import_target_module(_MODULE), "AllReduceCoalescedHandle")
    parameters = inspect.signature(undecorated(handle.wait)).parameters  # under @instrument_w_nvtx
    takes = "handle_dependency" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return "wait(handle_dependency=" in inspect.getsource(coordinator) and not takes


def realigned(original: Any) -> Any:
    """``original`` (``Init._convert_to_deepspeed_param`` as installed) recompiled from its own source with the
    all_reduce fetch's stride changed to ``ds_numel_aligned``, upstream's one-line fix. Raises DriftError unless
    the unaligned stride occurs exactly once."""
    lines, first = inspect.getsourcelines(original)
    source = "".join(lines)
    found = list(_UNALIGNED_STRIDE.finditer(source))
    if len(found) != 1:
        raise DriftError(f"{_TARGET.dotted}: expected the line 'start_param += param.ds_numel' once, found it "
                         f"{len(found)} times. Nothing was patched.")
    match = found[0]
    fixed = source[:match.start()] + match.group("indent") + _ALIGNED_STRIDE + source[match.end():]
    # the same line numbers as the installed file: tracebacks point at the lines a reader finds there
    text = "\n" * (first - 1) + textwrap.dedent(fixed)
    # one name per rewritten text: applying again reuses its linecache entry
    filename = _FILENAME.format(inspect.getsourcefile(original), hashlib.sha256(text.encode()).hexdigest()[:12])
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(text, filename, "exec"), vars(import_target_module(original.__module__)), namespace)  # noqa: S102
    function = namespace[original.__name__]
    function.__qualname__ = original.__qualname__
    function.__doc__ = original.__doc__
    return function


FIX = Zero3AllreduceFetchPaddedParams()
