"""Fix for zero3-activation-checkpoint-frozen-params: the backport of upstream PR #8148 ('Z3: Support for activation
ckpt with frozen params'), as three wrappers; no DeepSpeed function is copied.

Non-reentrant activation checkpointing re-runs the checkpointed forward inside backward. ZeRO-3's forward hooks
gather each module's parameters and release them after that module's forward, recompute or not. torch's
checkpoint keeps a frozen parameter (``requires_grad=False``) that an op saves as the tensor itself (a trainable
one is saved as a detached alias that keeps its shape), so once the release has set its data to an empty
partition, torch finds ``torch.Size([0])`` where the forward saved the full shape and raises ``CheckpointError``.

Upstream's change (``deepspeed/runtime/zero/partitioned_param_coordinator.py``), done here around the installed
methods:

* ``PartitionedParameterCoordinator.fetch_sub_module``: a backward fetch (``forward=False``) records its module
  as in backward on the coordinator (keyed by ``ds_id``; upstream's ``__active_backward_submodules``). A forward
  fetch while an autograd graph task runs (``torch._C._current_graph_task_id() != -1``: a checkpoint recompute)
  attributes the module's frozen parameters to the module most recently in backward: that module's ``ds_id``
  joins each parameter's ``ds_active_sub_modules``, so the forward release that follows leaves it gathered.
* ``PartitionedParameterCoordinator.release_sub_module``: a backward release of a module also releases the
  frozen parameters attributed to it (not the persistent ones, as upstream), and takes it off the record.
* ``DeepSpeedZeroOptimizer_Stage3.backward_epilogue``: after the original, the modules still recorded (a module
  whose post-backward hook never fires: its inputs need no gradient, e.g. the batch fed to the model) are
  released as that hook would have (upstream's ``release_backward_leftovers``), so no parameter stays gathered
  after ``engine.backward``.

The state lives in attributes of the fix's own (``_fixbook_...``) on the coordinator; reverting leaves them unused.
Releases before ``backward_epilogue`` existed in ZeRO-3's optimizer have no such point at the end of backward:
there the fix refuses (DriftError) instead of leaving the frozen parameters gathered after backward. The probe
reads the installed ``release_sub_module`` for upstream's ``ds_recompute_parameters``, and torch's checkpoint for the
line that keeps a recomputed tensor that does not require grad undetached (a torch that detaches every one does not
show the bug).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, DecoratedTarget, Target, import_target_module, undecorated

_COORDINATOR = "deepspeed.runtime.zero.partitioned_param_coordinator"
_FETCH = DecoratedTarget(_COORDINATOR, "PartitionedParameterCoordinator.fetch_sub_module")
_RELEASE = DecoratedTarget(_COORDINATOR, "PartitionedParameterCoordinator.release_sub_module")
_EPILOGUE = Target("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3.backward_epilogue")
# upstream's per-module set of the frozen parameters a recompute attributed to it (PR #8148)
_UPSTREAM_MARK = "ds_recompute_parameters"
# this fix's state on a coordinator: {ds_id: module} in backward, {ds_id: [params]} attributed by a recompute
_ACTIVE = "_fixbook_active_backward_submodules"
_RECOMPUTE = "_fixbook_recompute_parameters"
_RELEASE_PARAM = "_PartitionedParameterCoordinator__release_param"
# torch's non-reentrant checkpoint, in the recompute's pack hook: a tensor that does not require grad is kept as the
# tensor itself (where torch detaches every recomputed tensor, a released parameter's alias keeps its shape)
_UNDETACHED = "x = x.detach() if x.requires_grad else x"


class Zero3ActivationCheckpointFrozenParams(Fix):
    targets = (_FETCH, _RELEASE, _EPILOGUE)

    def check_targets(self) -> None:
        """As :meth:`Fix.check_targets`; a release whose ZeRO-3 optimizer has no ``backward_epilogue`` (nor a target
        at all) is refused in the words of any other drift: it is not the code this fix was written for."""
        for target in self.targets:
            try:
                target.raw()
            except DriftError as exc:
                raise DriftError(f"{target.dotted} is not the code this fix was written for: {exc}. Without it "
                                 "the fix has no point at the end of backward to release the frozen parameters it "
                                 "keeps gathered through a recompute. Nothing was patched.") from None
        super().check_targets()

    def read_code(self) -> Probe:
        coordinator = getattr(import_target_module(_COORDINATOR), "PartitionedParameterCoordinator")
        release = undecorated(vars(coordinator)["release_sub_module"])
        if _UPSTREAM_MARK in inspect.getsource(release):
            return Probe(False, "PartitionedParameterCoordinator.release_sub_module releases the frozen parameters a "
                                "checkpoint recompute attributed to a module in backward (ds_recompute_parameters, "
                                "upstream PR #8148)")
        if _UNDETACHED not in inspect.getsource(import_target_module("torch.utils.checkpoint")):
            return Probe(False, "this torch's non-reentrant checkpoint saves every recomputed tensor detached "
                                f"(torch/utils/checkpoint.py has no `{_UNDETACHED}`): a frozen parameter ZeRO-3 "
                                "releases keeps its shape in what the recompute saved")
        return Probe(True, "PartitionedParameterCoordinator.release_sub_module releases a module's parameters after "
                           "its forward also during a checkpoint recompute, and nothing keeps a frozen parameter "
                           "gathered for the backward that saved it (no ds_recompute_parameters); torch's "
                           f"checkpoint keeps such a parameter undetached (`{_UNDETACHED}`)")

    def patches(self) -> list[AttributePatch]:
        return [_FETCH.wrap(_recording_fetch), _RELEASE.wrap(_releasing_recompute_params),
                _EPILOGUE.wrap(_releasing_leftovers)]


def _state(coordinator: Any) -> tuple[dict[int, Any], dict[int, list[Any]]]:
    state = vars(coordinator)
    return state.setdefault(_ACTIVE, {}), state.setdefault(_RECOMPUTE, {})


def _own_params(module: Any) -> list[Any]:
    from deepspeed.utils import z3_leaf_module

    iter_params = getattr(import_target_module(_COORDINATOR), "iter_params")
    return list(iter_params(module, recurse=z3_leaf_module(module)))


def _release(coordinator: Any, owner_id: int, params: list[Any]) -> None:
    """Release ``params`` as their owner's backward release would (not persistent or external ones)."""
    release_param = getattr(coordinator, _RELEASE_PARAM)
    for param in params:
        param.ds_active_sub_modules.discard(owner_id)
        if not param.ds_persist and not param.is_external_param:
            release_param(param)


def _recording_fetch(original: Any) -> Any:
    @functools.wraps(original)
    def fetch_sub_module(self, current_submodule, forward):
        import torch

        active, recompute = _state(self)
        if not forward:
            active[current_submodule.ds_id] = current_submodule
        result = original(self, current_submodule, forward)
        if forward and active and torch._C._current_graph_task_id() != -1:
            # a forward inside backward: a checkpoint recompute; its frozen params stay until the owner's release
            owner = next(reversed(active.values()))
            for param in _own_params(current_submodule):
                if not param.requires_grad:
                    param.ds_active_sub_modules.add(owner.ds_id)
                    owned = recompute.setdefault(owner.ds_id, [])
                    if not any(param is p for p in owned):
                        owned.append(param)
        return result

    return fetch_sub_module


def _releasing_recompute_params(original: Any) -> Any:
    @functools.wraps(original)
    def release_sub_module(self, submodule, forward=False):
        result = original(self, submodule, forward=forward)
        if not forward:
            active, recompute = _state(self)
            active.pop(submodule.ds_id, None)
            _release(self, submodule.ds_id, recompute.pop(submodule.ds_id, []))
        return result

    return release_sub_module


def _releasing_leftovers(original: Any) -> Any:
    @functools.wraps(original)
    def backward_epilogue(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        coordinator = self.parameter_offload.get_param_coordinator()
        active, recompute = _state(coordinator)
        while active:
            ds_id, module = active.popitem()
            _release(coordinator, ds_id, _own_params(module) + recompute.pop(ds_id, []))
        return result

    return backward_epilogue


FIX = Zero3ActivationCheckpointFrozenParams()
