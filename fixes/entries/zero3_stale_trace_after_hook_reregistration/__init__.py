"""Fix for zero3-stale-trace-after-hook-reregistration: the backport of upstream PR #8043.

ZeRO-3's ``PartitionedParameterCoordinator`` records the order in which modules fetch their parameters during the
first forward/backward after its trace was invalidated (trace mode RECORD), keyed by each module's ``ds_id``, and
turns that record into its prefetch trace at the next ``reset_step()`` (the root module's forward pre-hook).
``deepspeed.runtime.zero.unwrap_model_for_generation`` (and TRL's ``add_hooks``, which does the same) removes the
module hooks and registers them again with ``DeepSpeedZeRoOffload._register_deepspeed_module`` (named
``_register_hooks_recursively`` in the oldest releases). Registration numbers the modules from the counter in its
``count=[0]`` default argument, which keeps counting from the first registration: every module gets a new
``ds_id``, and the record made under the old ones no longer matches. Upstream's fix:

* the registration method, called for the root module (``module is self.module``), first invalidates the
  coordinator's trace where it is not invalid already (``coordinator._invalidate_trace()``), so the next forward
  records afresh under the new ids. On the first registration the trace is still invalid, and the recursive calls
  for the submodules are not for the root: both do nothing new;
* ``PartitionedParameterCoordinator._clear_trace_structures`` (what ``_invalidate_trace`` clears) also empties
  ``__step_id_module_fetched_for``, the per-module fetch steps ``record_parameters`` pops from.

The fix wraps both methods (``functools.wraps``: the installed code runs unchanged after, and under, the added
lines). The wrapper passes the registration method's arguments through untouched, so its ``count`` default list is
the installed one. Apply it before ``unwrap_model_for_generation`` exits; a trace already made stale is not
repaired.

The probe reads the installed registration method: affected where it never calls ``_invalidate_trace``.
"""
from __future__ import annotations

import collections
import functools
import inspect
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_OFFLOAD = "deepspeed.runtime.zero.parameter_offload"
_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
# The registration method, by its two names (renamed by PR #6847); each release has exactly one of them.
_LAZY = Target(_OFFLOAD, "DeepSpeedZeRoOffload._register_hooks_recursively")
_EAGER = Target(_OFFLOAD, "DeepSpeedZeRoOffload._register_deepspeed_module")
_CLEAR = Target(_COORDINATOR, "PartitionedParameterCoordinator._clear_trace_structures")
# PartitionedParameterCoordinator.__step_id_module_fetched_for, as Python stores the private attribute
_FETCH_STEPS = "_PartitionedParameterCoordinator__step_id_module_fetched_for"
_INVALIDATES = "_invalidate_trace("


class Zero3StaleTraceAfterHookReregistration(Fix):
    targets = (_LAZY, _EAGER, _CLEAR)
    # unwrap_model_for_generation gathers every parameter with one GatheredParameters: on CPU (gloo) the generation
    # inside it must read gathered values, not buffers still being written
    requires = ("zero3-gathered-params-cpu-race",)

    def check_targets(self) -> None:
        """As :meth:`Fix.check_targets`, for the registration method this release has (one of its two names) and
        ``_clear_trace_structures``."""
        present = [target for target in (_LAZY, _EAGER) if _exists(target)]
        if not present:
            raise DriftError(f"neither {_LAZY.dotted} nor {_EAGER.dotted} exists: nothing was patched")
        for target in (*present, _CLEAR):
            target.check(self.known_fingerprints(target))

    def read_code(self) -> Probe:
        register = _registration_target()
        if register is None:
            return Probe(False, "DeepSpeedZeRoOffload has neither registration method this fix knows")
        name = register.qualname.rsplit(".", 1)[-1]
        if _INVALIDATES in inspect.getsource(register.code()):
            return Probe(False, f"{name} invalidates the coordinator's trace when the root module is registered "
                                "again (upstream PR #8043)")
        return Probe(True, f"{name} registers the hooks again under new ds_ids and never invalidates the "
                           "coordinator's trace: a trace recorded under the old ids stays in use")

    def patches(self) -> list[AttributePatch]:
        register = _registration_target()
        if register is None:
            raise DriftError(f"neither {_LAZY.dotted} nor {_EAGER.dotted} exists: nothing was patched")
        return [register.wrap(_invalidating_on_root), _CLEAR.wrap(_clearing_fetch_steps)]


def _exists(target: Target) -> bool:
    owner, name = target.owner_and_name()
    return name in vars(owner)


def _registration_target() -> Target | None:
    return next((target for target in (_EAGER, _LAZY) if _exists(target)), None)


def _invalidating_on_root(original: Any) -> Any:
    @functools.wraps(original)
    def register(self, module, *args, **kwargs):
        # upstream PR #8043: registering the root's hooks again leaves the coordinator's trace stale;
        # invalidate it so that the next forward records afresh
        if module is self.module:
            coordinator = self.get_param_coordinator()
            if coordinator is not None and not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()
        return original(self, module, *args, **kwargs)  # count: the installed default, untouched

    return register


def _clearing_fetch_steps(original: Any) -> Any:
    @functools.wraps(original)
    def _clear_trace_structures(self) -> None:
        original(self)
        # upstream PR #8043: a stale entry here makes record_parameters() pop an empty deque
        setattr(self, _FETCH_STEPS, collections.defaultdict(collections.deque))

    return _clear_trace_structures


FIX = Zero3StaleTraceAfterHookReregistration()
