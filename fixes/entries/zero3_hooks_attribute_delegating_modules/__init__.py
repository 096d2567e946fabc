"""Fix for zero3-hooks-attribute-delegating-modules: the backport of upstream PR #8144, which makes ZeRO-3's
per-module hook state *instance-local*.

ZeRO-3 (``deepspeed/runtime/zero/parameter_offload.py``) decides whether a module already has its backward
hook classes and counters with ``hasattr(module, ...)``. On a module whose class defines ``__getattr__`` that
forwards unknown names to a wrapped module (PEFT's ``ModulesToSaveWrapper``, many adapter wrappers),
``hasattr`` answers with the *child's* attributes, so the wrapper gets no hook classes of its own and runs its
child's (bound to the child). Upstream replaced those ``hasattr`` checks by ``name in module.__dict__``.

The fix gives ``parameter_offload`` a module-level ``hasattr`` (it shadows the builtin in that module only;
no DeepSpeed function is replaced): for the four names of ZeRO-3's per-module hook state -- ``pre_bwd_fn``,
``post_bwd_fn``, ``applied_pre_backward_ref_cnt`` and ``ds_grads_remaining`` -- asked of an
``nn.Module``, it answers from the module's own ``__dict__``, upstream's check; for every other name or
object it is the builtin. On an ordinary module the answer is the same as the builtin's (DeepSpeed stores
these attributes in the instance ``__dict__``). The installed release's own code then runs unchanged and
makes every module, wrappers included, hook classes and counters bound to itself, in each of the three
shapes this code has had:

* the hook classes made lazily inside the hooks the registration method registers (under its older name
  ``_register_hooks_recursively``, and in the first releases of ``_register_deepspeed_module``), where the
  wrapper ran its child's pre-backward class, so the wrapper's own parameters were never gathered for
  backward;
* made by ``_register_deepspeed_module`` itself, legacy ``forward(ctx, ...)`` classes or with
  ``setup_context`` (PR #7916), where the wrapper's post-backward class counts on the child's
  ``ds_grads_remaining`` before the child's forward has set it: ``AttributeError`` in the first forward.

Apply it before ``deepspeed.initialize``: where the classes are made at registration, a model registered
without the fix keeps the child's classes. Another fix that rebuilds the hook classes elsewhere
(``zero3-hooks-torch-func``) copies the builtin ``hasattr`` check for ``applied_pre_backward_ref_cnt``
into its own module; there the wrapper's pre-backward counter can start from the child's, which makes its
prefetch run when it need not, never skips it.

The probe reads the installed registration method for a ``hasattr`` check of ``pre_bwd_fn``/``post_bwd_fn``.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.parameter_offload"
_CLASS = "DeepSpeedZeRoOffload"
# The registration method, by its two names (it was renamed); each release has exactly one of them. Where it
# makes the hook classes lazily (inside the hooks it registers) or itself, the checks are the same hasattr calls.
_LAZY = Target(_MODULE, f"{_CLASS}._register_hooks_recursively")
_EAGER = Target(_MODULE, f"{_CLASS}._register_deepspeed_module")
# ZeRO-3's per-module hook state, looked up with hasattr(module, ...) in the registration code
INSTANCE_LOCAL = frozenset({"pre_bwd_fn", "post_bwd_fn", "applied_pre_backward_ref_cnt", "ds_grads_remaining"})
_DELEGATED_CHECKS = ('hasattr(module, "pre_bwd_fn")', 'hasattr(module, "post_bwd_fn")')


class Zero3HooksAttributeDelegatingModules(Fix):
    targets = (_LAZY, _EAGER)

    def check_targets(self) -> None:
        """As :meth:`Fix.check_targets`, for the registration method this release has (one of the two names)."""
        present = [target for target in self.targets if _exists(target)]
        if not present:
            raise DriftError(f"neither {_LAZY.dotted} nor {_EAGER.dotted} exists: nothing was patched")
        for target in present:
            target.check(self.known_fingerprints(target))

    def read_code(self) -> Probe:
        register = _registration_target()
        if register is None:
            return Probe(False, f"{_CLASS} has neither registration method this fix knows")
        source = inspect.getsource(register.code())
        found = [check for check in _DELEGATED_CHECKS if check in source]
        name = register.qualname.rsplit(".", 1)[-1]
        if found:
            return Probe(True, f"{name} checks {' and '.join(found)}: on a module whose __getattr__ forwards to a "
                               "child, that finds the child's hook classes")
        return Probe(False, f"{name} does not check the hook classes with hasattr(module, ...) (upstream PR #8144 "
                            "checks module.__dict__)")

    def patches(self) -> list[AttributePatch]:
        return [AttributePatch(import_target_module(_MODULE), "hasattr", instance_local_hasattr())]


def _exists(target: Target) -> bool:
    owner, name = target.owner_and_name()
    return name in vars(owner)


def _registration_target() -> Target | None:
    return next((target for target in (_EAGER, _LAZY) if _exists(target)), None)


def instance_local_hasattr() -> Any:
    """The ``hasattr`` the fix puts into ``parameter_offload``'s globals: upstream's ``name in module.__dict__``
    for ZeRO-3's per-module hook state (:data:`INSTANCE_LOCAL`) asked of an ``nn.Module``, the builtin otherwise."""
    import builtins

    import torch

    module_type = torch.nn.Module
    builtin_hasattr = builtins.hasattr

    def hasattr(obj: Any, name: str) -> bool:  # noqa: A001 - it shadows the builtin in parameter_offload only
        if name in INSTANCE_LOCAL and isinstance(obj, module_type):
            return name in vars(obj)
        return builtin_hasattr(obj, name)

    return hasattr


FIX = Zero3HooksAttributeDelegatingModules()
