"""Fix for zero3-universal-load-first-group-hyperparameters: wraps
``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``, the ZeRO-3 optimizer's
universal-checkpoint loader (upstream PR #7585's, 0.18.0 on).

The loader runs as it is; it ends by copying every key of the first saved parameter group
(``optim_sd[OPTIMIZER_STATE_DICT]["param_groups"][0]``) into each of the optimizer's groups. Afterwards the wrapper
reads the same global state file again (``<checkpoint>/zero/optimizer_state.pt``, small: hyperparameters and loss
scaler) and gives each group its own saved hyperparameters (every key but ``params``), where the checkpoint saved
as many groups as the optimizer has; otherwise it leaves what the loader did. The loader's own steps after the copy
(NVMe swapping, the fp16 copies of the weights) do not read the hyperparameters, so setting them after it returns
is the same as setting them in its loop. Being a wrapper, it composes with the fix it ``requires``,
zero3-universal-resume-shared-adam-step (also a wrapper of the same loader: each sub-group's own Adam ``step``),
which a resume with two parameter groups (two ZeRO-3 sub-groups) needs as well to continue as the uninterrupted run
does; ``fixes.apply`` of this fix applies that one first.

The method is replaced on the class, so every ZeRO-3 engine of this process loads with it: apply it before
``load_checkpoint``. Before 0.18.0 the loader hands the saved state to ``torch.optim.Optimizer.load_state_dict``,
which keeps each group's own hyperparameters (and fails for several sub-groups: entry
ds-to-universal-zero3-sub-groups). The probe reads the loader: affected where it copies ``param_groups[0]`` into
every group.
"""
from __future__ import annotations

import functools
import inspect
import os
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.zero.stage3",
                 "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3")
_FIRST_GROUP = '[OPTIMIZER_STATE_DICT]["param_groups"][0].items()'


class Zero3UniversalLoadFirstGroupHyperparameters(Fix):
    targets = (_TARGET,)
    requires = ("zero3-universal-resume-shared-adam-step",)

    def read_code(self) -> Probe:
        source = inspect.getsource(_TARGET.code())
        if _FIRST_GROUP in source and "for param_group in self.optimizer.param_groups:" in source:
            return Probe(True, "load_hp_checkpoint_state_from_checkpoint_dir_stage3 copies the first saved parameter "
                               "group's hyperparameters (param_groups[0]) into every parameter group")
        return Probe(False, "load_hp_checkpoint_state_from_checkpoint_dir_stage3 does not copy param_groups[0] into "
                            "every parameter group")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_each_group_its_own)]


def _each_group_its_own(original: Any) -> Any:
    @functools.wraps(original)
    def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, checkpoint_dir, *args, **kwargs):
        import torch
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

        result = original(self, checkpoint_dir, *args, **kwargs)
        saved = torch.load(os.path.join(checkpoint_dir, "zero", "optimizer_state.pt"),
                           weights_only=False)[OPTIMIZER_STATE_DICT]["param_groups"]
        if len(saved) == len(self.optimizer.param_groups):
            for group, own in zip(self.optimizer.param_groups, saved):
                group.update({key: value for key, value in own.items() if key != "params"})
        return result

    return load_hp_checkpoint_state_from_checkpoint_dir_stage3


FIX = Zero3UniversalLoadFirstGroupHyperparameters()
