"""Fix for zero3-gathered-params-edits-lost: upstream PR #7832's detection, on every exit and for every way of editing.

``GatheredParameters.__exit__`` (``deepspeed/runtime/zero/partition_parameters.py``) with ``modifier_rank=None``
re-partitions with ``has_been_updated=False``: each rank drops its gathered copy and keeps its old partition, so
whatever was written into the parameters inside the block is gone. Upstream's answer (#7817, completed by #7832) is
to raise a clear error instead, but only when ``zero_optimization.enable_sanity_checks`` is true (off by default),
and it notices an edit only by the parameter's version counter or data pointer, so ``param.data.copy_(...)`` or
``param.data.mul_(...)`` still vanish silently with the check on.

The fix raises upstream's error, always. Two wrappers, each calling the original:

* ``GatheredParameters.__enter__``: after the gather, for a block without ``modifier_rank`` opened by code outside
  DeepSpeed's own package, remember per parameter its data pointer, its version counter and a copy of this rank's
  share of the gathered values (its partition's slice of the flattened tensor, 1/world_size of it).
* ``GatheredParameters.__exit__``: a parameter counts as edited on this rank if an in-place operation on the
  parameter bumped its version counter (what upstream checks: ``param.copy_``, ``load_state_dict``,
  ``torch.nn.init``), if its data was replaced by a tensor of another size, or if this rank's share differs bit for
  bit from the copy (``param.data`` edits, ``param.data = ...``). The ranks agree with one all-reduce (MAX) over the
  parameters' partition group, as upstream's does, so they all raise or none does. Then the original exit runs (it
  re-partitions and, on newer releases, releases the nesting bookkeeping), and only then the error is raised:
  upstream's message, plus what happened to the edit. An exception already leaving the block is not replaced.

Not counted as an edit: a parameter DeepSpeed itself released during the block (a forward's hooks partitioned it:
``ds_status`` is no longer AVAILABLE), and values gathered again unchanged into a new buffer. Blocks opened by
DeepSpeed's own modules are not checked: DeepSpeed's hybrid engine fuses LoRA weights into gathered parameters with
``modifier_rank=None`` and relies on the exit discarding them. Edits made through ``.data`` on some ranks only, and
only inside other ranks' shares, are not seen (no rank holds a copy of them).

The copy taken on entry assumes the gather has landed when ``__enter__`` returns; on the CPU accelerator DeepSpeed's
coalesced gather may still be writing (entry ``zero3-gathered-params-cpu-race``), so that fix is required (a no-op
where its bug is absent). Apply any time: both methods are looked up on every ``with``.
"""
from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.runtime.zero.partition_parameters"
_ENTER = Target(_MODULE, "GatheredParameters.__enter__")
_EXIT = Target(_MODULE, "GatheredParameters.__exit__")
# upstream's detection (#7817/#7832) raises with this text; the releases before it have no check at all
_DETECTS = "in-place modification"
# ... and records the parameters' versions on entry only under this config switch
_GATE = "enable_sanity_checks"
# upstream's message, word for word (deepspeed/runtime/zero/partition_parameters.py, GatheredParameters)
MESSAGE = ("Detected in-place modification of ZeRO-3 parameters inside GatheredParameters with modifier_rank=None. "
           "Use modifier_rank=<rank> to broadcast updates across ranks.")
_WATCH = "_fixbook_edit_watch"  # what __enter__ remembers for __exit__, on the GatheredParameters object


class Zero3GatheredParamsEditsLost(Fix):
    targets = (_ENTER, _EXIT)
    # the copy taken on entry must see the gathered values: on CPU (gloo) the coalesced gather may still be writing
    requires = ("zero3-gathered-params-cpu-race",)

    def read_code(self) -> Probe:
        cls = getattr(import_target_module(_MODULE), "GatheredParameters")
        # the methods as the class holds them now (releases split __exit__ into helpers such as _exit)
        sources = {name: inspect.getsource(value) for name, value in vars(cls).items() if inspect.isfunction(value)}
        if not any(_DETECTS in source for source in sources.values()):
            return Probe(True, "GatheredParameters.__exit__ re-partitions with has_been_updated=False when "
                               "modifier_rank is None and never checks for edits: they are discarded silently")
        if _GATE in sources.get("__enter__", ""):
            return Probe(True, "GatheredParameters checks for edits with modifier_rank=None only when "
                               "zero_optimization.enable_sanity_checks is true (off by default); otherwise they "
                               "are discarded silently")
        return Probe(False, "GatheredParameters checks for edits with modifier_rank=None on every exit")

    def patches(self) -> list[AttributePatch]:
        return [_ENTER.wrap(_watching), _EXIT.wrap(_raising)]


def _opened_by_deepspeed(frame: Any) -> bool:
    """Whether the ``with`` statement whose frame is ``frame`` is in DeepSpeed's own package."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == "deepspeed" or name.startswith("deepspeed.")


def _share(param: Any) -> Any:
    """This rank's share of ``param``'s gathered values: its partition's slice of the flattened tensor (a view),
    or None where the parameter is not gathered (not AVAILABLE, or its data not the full contiguous tensor)."""
    from deepspeed import comm as dist
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    data = param.data
    if param.ds_status != ZeroParamStatus.AVAILABLE or data.numel() != param.ds_numel or not data.is_contiguous():
        return None
    group = param.ds_process_group
    size, rank = dist.get_world_size(group=group), dist.get_rank(group=group)
    chunk = -(-data.numel() // size)
    return data.view(-1)[rank * chunk:(rank + 1) * chunk]


def _watch(param: Any) -> tuple[Any, int, int, Any]:
    share = _share(param)
    return param, param.data.data_ptr(), param._version, None if share is None else share.clone()


def _same_bits(now: Any, before: Any) -> bool:
    import torch

    if now.dtype != before.dtype or now.shape != before.shape:
        return False
    now = now.to(before.device)
    return torch.equal(now.view(torch.uint8), before.view(torch.uint8))


def _edited(param: Any, data_ptr: int, version: int, share: Any) -> bool:
    """Whether this rank edited ``param`` inside the block (see the module docstring)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if param.ds_status != ZeroParamStatus.AVAILABLE:
        return False  # DeepSpeed itself released it inside the block: nothing of the user's is held
    if param.data.data_ptr() == data_ptr and param._version != version:
        return True  # an in-place operation on the parameter (upstream's criterion)
    if param.data.numel() != param.ds_numel:
        return True  # its data replaced by a tensor of another size
    now = _share(param)
    return share is not None and (now is None or not _same_bits(now, share))


def _watching(original: Any) -> Any:
    @functools.wraps(original)
    def __enter__(self):
        result = original(self)
        if (self.enabled and self.src_rank is None and self.params
                and not _opened_by_deepspeed(sys._getframe(1))):
            setattr(self, _WATCH, [_watch(p) for p in self.params])
        return result

    return __enter__


def _raising(original: Any) -> Any:
    @functools.wraps(original)
    def __exit__(self, *exc):
        watched = self.__dict__.pop(_WATCH, None)
        if not watched:
            return original(self, *exc)
        import torch
        from deepspeed import comm as dist
        from deepspeed.accelerator import get_accelerator

        edited = [p.ds_id for p, *before in watched if _edited(p, *before)]
        flag = torch.tensor(int(bool(edited)), device=get_accelerator().current_device_name())
        if dist.is_initialized():  # every rank raises, or none: the next collective would not match otherwise
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.params[0].ds_process_group)
        result = original(self, *exc)  # re-partitions: the edits are discarded, as on every release
        if flag.item() and not any(exc):
            here = f"ds_id {', '.join(map(str, edited))}" if edited else "none (edited on another rank)"
            raise RuntimeError(f"{MESSAGE} The edits were discarded when the block exited: without modifier_rank "
                               f"every rank drops its gathered copy and keeps its old partition. Parameters edited "
                               f"on this rank: {here}.")
        return result

    return __exit__


FIX = Zero3GatheredParamsEditsLost()
