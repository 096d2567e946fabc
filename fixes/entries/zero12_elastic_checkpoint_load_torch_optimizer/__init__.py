"""Fix for zero12-elastic-checkpoint-load-torch-optimizer: wraps three methods of
``deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer`` on the load path of an elastic checkpoint.

With ``zero_optimization.elastic_checkpoint`` on, ``state_dict`` saves each parameter group's optimizer state as a
list (``base_optimizer_state``) and the step count under ``base_optimizer_state_step`` only where the optimizer keeps
one in its parameter groups (``"step" in self.optimizer.param_groups[0]``: DeepSpeed's own Adam). A torch optimizer
keeps its step count in the per-parameter state instead (``state["step"]``, a 0-dim tensor), so no
``base_optimizer_state_step`` is saved. On load, ``_restore_elastic_base_optimizer_state``:

- calls ``_restore_step_from_elastic_checkpoint``, which asserts ``BASE_OPTIMIZER_STATE_STEP in all_state_dict[0]``:
  the load stops there with a bare ``AssertionError``;
- past that, would hand every tensor of the saved state, the 0-dim step count too, to
  ``_partition_base_optimizer_state``, which flattens the ranks' tensors into one aligned buffer and returns this
  rank's slice (the step count would come back as a padded vector);
- and ``_restore_base_optimizer_state`` pads every tensor it restores into a fresh flat buffer and sets every group's
  ``"step"`` to the saved group step.

The wrappers: ``_restore_step_from_elastic_checkpoint`` answers None where no rank saved a group step (the step
count is in the per-parameter state) and asks the original otherwise; ``_partition_base_optimizer_state`` returns a
0-dim tensor as saved (not partitioned, as the original already does for a non-tensor value), only where the
installed method has no ``is_partition_state`` parameter (newer code returns such a tensor as saved itself); and
``_restore_base_optimizer_state`` hands the original the state without its 0-dim tensors, leaves the groups' ``"step"``
as they were where the step is None, and puts each 0-dim tensor back as torch's ``Optimizer.load_state_dict`` does
(copied into the existing tensor, or the saved one: on the parameter's device in float32 for a ``capturable`` or
``fused`` group). A checkpoint with a group step and no 0-dim tensor goes through the originals unchanged.

The probe reads ``_restore_step_from_elastic_checkpoint``'s source: affected where it asserts that the step key is
in the saved state dict.
"""
from __future__ import annotations

import ast
import functools
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.runtime.zero.stage_1_and_2"
_RESTORE_STEP = Target(_MODULE, "DeepSpeedZeroOptimizer._restore_step_from_elastic_checkpoint")
_PARTITION = Target(_MODULE, "DeepSpeedZeroOptimizer._partition_base_optimizer_state")
_RESTORE_STATE = Target(_MODULE, "DeepSpeedZeroOptimizer._restore_base_optimizer_state")
_STEP_KEY = "base_optimizer_state_step"  # deepspeed.checkpoint.constants.BASE_OPTIMIZER_STATE_STEP


class Zero12ElasticCheckpointLoadTorchOptimizer(Fix):
    targets = (_RESTORE_STEP, _PARTITION, _RESTORE_STATE)
    # where their bugs are installed, a torch optimizer's elastic checkpoint cannot be saved (the first), or
    # DeepSpeed's torch.load of it fails under a torch that loads weights only by default (the second)
    requires = ("zero12-checkpoint-zero-dim-state", "torch-load-weights-only-default")

    def read_code(self) -> Probe:
        function = ast.parse(textwrap.dedent(_RESTORE_STEP.source())).body[0]
        for node in ast.walk(function):
            if isinstance(node, ast.Assert) and isinstance(node.test, ast.Compare) \
                    and any(isinstance(op, ast.In) for op in node.test.ops) \
                    and "BASE_OPTIMIZER_STATE_STEP" in ast.unparse(node.test.left):
                return Probe(True, "_restore_step_from_elastic_checkpoint asserts "
                                   f"`{ast.unparse(node.test)}`: an elastic checkpoint of a torch optimizer, whose "
                                   "step count is in the per-parameter state, saves no group step and cannot be loaded")
        return Probe(False, "_restore_step_from_elastic_checkpoint does not require a saved group step")

    def patches(self) -> list[AttributePatch]:
        patches = [_RESTORE_STEP.wrap(_step_where_saved), _RESTORE_STATE.wrap(_restoring_zero_dim_state)]
        if not _partitions_only_partition_states():
            patches.insert(1, _PARTITION.wrap(_zero_dim_unpartitioned))
        return patches


def _partitions_only_partition_states() -> bool:
    """Whether the installed ``_partition_base_optimizer_state`` takes ``is_partition_state`` (its caller then
    marks a tensor that is not shaped like the rank's partition, such as a 0-dim step count, and it is returned as
    saved): no wrapper is needed there."""
    function = ast.parse(textwrap.dedent(_PARTITION.source())).body[0]
    return any(argument.arg == "is_partition_state" for argument in function.args.args + function.args.kwonlyargs)


def _is_zero_dim_tensor(value: Any) -> bool:
    import torch

    return torch.is_tensor(value) and value.dim() == 0


def _step_where_saved(original: Any) -> Any:
    @functools.wraps(original)
    def _restore_step_from_elastic_checkpoint(self, all_state_dict):
        if not any(_STEP_KEY in state_dict for state_dict in all_state_dict):
            return None  # a torch optimizer: its step count is in the per-parameter state
        return original(self, all_state_dict)

    return _restore_step_from_elastic_checkpoint


def _zero_dim_unpartitioned(original: Any) -> Any:
    @functools.wraps(original)
    def _partition_base_optimizer_state(self, state_key, all_partition_states, group_id, *args, **kwargs):
        if _is_zero_dim_tensor(all_partition_states[0]):
            return all_partition_states[0]  # a step count: the same on every rank, nothing to partition
        return original(self, state_key, all_partition_states, group_id, *args, **kwargs)

    return _partition_base_optimizer_state


def _as_loaded(saved: Any, param: Any, group: dict) -> Any:
    """A saved 0-dim tensor as torch's ``Optimizer.load_state_dict`` places a ``step``: on the parameter's device
    in float32 for a capturable or fused group, else as saved."""
    import torch

    if group.get("capturable") or group.get("fused"):
        return saved.detach().to(dtype=torch.float32, device=param.device).clone()
    return saved.detach().clone()


def _restoring_zero_dim_state(original: Any) -> Any:
    @functools.wraps(original)
    def _restore_base_optimizer_state(self, base_optimizer_group_states, base_optimizer_state_step, group_paddings):
        states = base_optimizer_group_states
        if type(states) == dict:  # noqa: E721 - the original's own test
            states = states["state"]
        groups = self.optimizer.param_groups
        scalars = [{key: value for key, value in states[i].items() if _is_zero_dim_tensor(value)}
                   for i in range(len(groups))]
        if base_optimizer_state_step is not None and not any(scalars):
            return original(self, base_optimizer_group_states, base_optimizer_state_step, group_paddings)
        lean = [{key: value for key, value in states[i].items() if key not in scalars[i]} for i in range(len(groups))]
        before = [(("step" in group), group.get("step")) for group in groups]
        result = original(self, lean, base_optimizer_state_step, group_paddings)
        if base_optimizer_state_step is None:  # no group step saved: the groups keep theirs
            for group, (had, value) in zip(groups, before):
                if had:
                    group["step"] = value
                else:
                    group.pop("step", None)
        for group, saved in zip(groups, scalars):
            param = group["params"][0]
            state = self.optimizer.state[param]
            for key, value in saved.items():
                current = state.get(key)
                if _is_zero_dim_tensor(current):
                    current.data.copy_(value.data)
                else:
                    state[key] = _as_loaded(value, param, group)
        return result

    return _restore_base_optimizer_state


FIX = Zero12ElasticCheckpointLoadTorchOptimizer()
