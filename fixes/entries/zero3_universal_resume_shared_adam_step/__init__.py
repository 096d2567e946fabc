"""Fix for zero3-universal-resume-shared-adam-step: wraps
``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``.

The loader runs as it is; afterwards each sub-group's Adam state gets its own ``step`` tensor, a
``clone()`` of the one the loader assigned (same value, dtype and device), so that torch's Adam, which
increments ``state['step']`` in place, advances each sub-group once per optimizer step, as it does in an
uninterrupted run. A ``step`` that is not a tensor (an int, a float) is immutable and left as it is. The
loader's own steps after the assignment (hyperparameters, NVMe swapping, the fp16 copies) do not read
``step``, so cloning after it returns is the same as cloning at the assignment.

With ``offload_optimizer`` to NVMe (``swap_optimizer``) the loader purges the swapped state after the
assignment; the wrapper then clones what ``optimizer.state`` still holds and nothing else.

The probe reads the loader's source: affected when it assigns ``...['step'] = <name>`` inside a loop over
the sub-groups, ``<name>`` bound once before the loop (from the optimizer file's ``state[0]['step']``) and
not copied.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.zero.stage3",
                 "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3")


class Zero3UniversalResumeSharedAdamStep(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        source = textwrap.dedent(inspect.getsource(_TARGET.code()))
        shared = _shared_step_names(ast.parse(source))
        if shared:
            return Probe(True, f"load_hp_checkpoint_state_from_checkpoint_dir_stage3 assigns the one tensor "
                               f"{shared[0]} (optimizer state[0]['step']) to every sub-group's Adam state['step'] "
                               f"in its loop over the sub-groups")
        return Probe(False, "load_hp_checkpoint_state_from_checkpoint_dir_stage3 does not assign one step object "
                            "bound before its loop to every sub-group's Adam state")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_own_step_per_sub_group)]


def _shared_step_names(tree: ast.AST) -> list[str]:
    """Names ``n`` with ``...['step'] = n`` inside a ``for`` loop, ``n`` bound outside every loop from an
    expression that reads ``['step']``."""
    bound_outside: set[str] = set()
    loops = [node for node in ast.walk(tree) if isinstance(node, (ast.For, ast.While))]
    in_loop = {id(inner) for loop in loops for inner in ast.walk(loop) if inner is not loop}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and id(node) not in in_loop and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and _reads_step(node.value)):
            bound_outside.add(node.targets[0].id)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and id(node) in in_loop and isinstance(node.value, ast.Name)
                and node.value.id in bound_outside
                and any(isinstance(t, ast.Subscript) and _is_step_key(t.slice) for t in node.targets)):
            found.append(node.value.id)
    return found


def _is_step_key(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == "step"


def _reads_step(node: ast.AST) -> bool:
    return isinstance(node, ast.Subscript) and _is_step_key(node.slice)


def _own_step_per_sub_group(original: Any) -> Any:
    @functools.wraps(original)
    def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, *args, **kwargs):
        import torch

        result = original(self, *args, **kwargs)
        for fp32_param in self.fp32_partitioned_groups_flat:
            state = self.optimizer.state.get(fp32_param)
            if state is not None and torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()  # each sub-group's own counter
        return result

    return load_hp_checkpoint_state_from_checkpoint_dir_stage3


FIX = Zero3UniversalResumeSharedAdamStep()
