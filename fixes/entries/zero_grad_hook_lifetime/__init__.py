"""On torch < 2.1, ZeRO's gradient hooks die at once: no hook fires, ZeRO-2's IPG buckets stay empty.

``deepspeed.utils.torch.register_grad_hook`` uses ``param.register_post_accumulate_grad_hook`` on
torch ≥ 2.1. On older torch it registers the hook on the parameter's ``AccumulateGrad`` node,
reached through ``param.expand_as(param).grad_fn``, and keeps no reference to that node. A leaf
tensor holds its AccumulateGrad node only weakly, so node and hook are freed at once and the next
forward makes a fresh node without a hook. Before PR #7189 (first in 0.16.6) ZeRO-1/2 kept the
nodes alive in a list; #7189 switched to the helper and dropped the list. ZeRO-3 and the BF16
optimizer use the same helper. Upstream issue (seed 002) is still open.

The fix keeps each node alive for the lifetime of its parameter on the fallback branch. Where
``register_post_accumulate_grad_hook`` is used (torch ≥ 2.1) there is nothing to fix.

On a real torch < 2.1 (the Fixbook's ``torch-2.0`` environment: PyTorch 2.0.1) the bug shows as
it is. ``simulate_torch_before_2_1()`` makes DeepSpeed take its pre-2.1 branch on a newer torch; it
exists only to reproduce the bug where no torch 2.0 is at hand (the default ``cpu`` environment), and
the probe's evidence says which of the two it saw.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Iterator

from packaging.version import Version

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_HELPER_MODULE = "deepspeed.utils.torch"
# Modules that import the helper by name, so their own binding must be patched too.
_USERS = ("deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.zero.stage3", "deepspeed.runtime.bf16_optimizer")


class ZeroGradHookLifetime(Fix):
    targets = (Target(_HELPER_MODULE, "register_grad_hook"),)

    def read_code(self) -> Probe:
        helpers = import_target_module(_HELPER_MODULE)
        if not hasattr(helpers, "register_grad_hook"):
            return Probe(False, "no register_grad_hook helper: ZeRO registers and keeps its own hooks")
        if not hasattr(import_target_module(_USERS[0]), "register_grad_hook"):
            return Probe(False, "ZeRO-1/2 keep their AccumulateGrad nodes (grad_accs) instead of using "
                                "register_grad_hook (before PR #7189)")
        if helpers.required_torch_version(min_version=2.1):
            return Probe(False, f"torch {_torch_version()} ≥ 2.1: DeepSpeed uses register_post_accumulate_grad_hook")
        if "grad_acc.register_hook(hook)" in inspect.getsource(helpers.register_grad_hook):
            return Probe(True, f"{torch_branch()}: the torch < 2.1 branch hooks an AccumulateGrad node it does not keep")
        return Probe(False, f"{torch_branch()}: the torch < 2.1 branch of register_grad_hook differs from the leaky one")

    def patches(self) -> list[AttributePatch]:
        helpers = import_target_module(_HELPER_MODULE)
        original = helpers.register_grad_hook
        replacement = _keeping_node(helpers)
        patches = [AttributePatch(helpers, "register_grad_hook", replacement)]
        for name in _USERS:
            module = import_target_module(name)
            if getattr(module, "register_grad_hook", None) is original:
                patches.append(AttributePatch(module, "register_grad_hook", replacement))
        return patches


def _keeping_node(helpers: Any) -> Any:
    def register_grad_hook(param, hook):
        if helpers.required_torch_version(min_version=2.1):
            return param.register_post_accumulate_grad_hook(hook)
        param_tmp = param.expand_as(param)
        grad_acc = param_tmp.grad_fn.next_functions[0][0]
        handle = grad_acc.register_hook(hook)
        # The parameter only weakly references its AccumulateGrad node: keep the node (and so its
        # hook) alive as long as the parameter, as ZeRO-1/2 did before PR #7189.
        param.__dict__.setdefault("_fixbook_grad_acc_nodes", []).append(grad_acc)
        return handle

    return register_grad_hook


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def torch_before_2_1() -> bool:
    """Whether the running torch is older than 2.1 (no ``register_post_accumulate_grad_hook``): the bug
    shows without simulation."""
    return Version(_torch_version().split("+")[0]).release[:2] < (2, 1)


_SIMULATING: list[bool] = []  # non-empty inside simulate_torch_before_2_1()


def torch_branch() -> str:
    """Which torch < 2.1 branch runs: real (``torch 2.0.1``) or selected on a newer torch."""
    if _SIMULATING:
        return f"torch {_torch_version()} with DeepSpeed's pre-2.1 branch simulated (simulate_torch_before_2_1)"
    return f"torch {_torch_version()}"


@contextlib.contextmanager
def simulate_torch_before_2_1() -> Iterator[None]:
    """Within the block, DeepSpeed's ``required_torch_version(min_version=2.1)`` answers False, so
    ``register_grad_hook`` takes its torch < 2.1 branch. For reproducing on a newer torch only."""
    helpers = import_target_module(_HELPER_MODULE)
    real = helpers.required_torch_version

    def required_torch_version(min_version=None, max_version=None):
        if min_version is not None and float(min_version) >= 2.1 and max_version is None:
            return False
        return real(min_version=min_version, max_version=max_version)

    helpers.required_torch_version = required_torch_version
    _SIMULATING.append(True)
    try:
        yield
    finally:
        _SIMULATING.pop()
        helpers.required_torch_version = real


FIX = ZeroGradHookLifetime()
