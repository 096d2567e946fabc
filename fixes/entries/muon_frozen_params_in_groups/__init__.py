"""Fix for muon-frozen-params-in-groups: wraps ``deepspeed.runtime.engine.DeepSpeedEngine._configure_basic_optimizer``.

With the config's ``"optimizer": {"type": "Muon"}``, ``_configure_basic_optimizer`` splits ``model_parameters`` by
their ``use_muon`` tag (``deepspeed.initialize`` tags every matrix True, the rest False) into the two groups of
``MuonWithAuxAdam`` and keeps every parameter, frozen or not. Upstream PR #7869 keeps only parameters with
``requires_grad`` in either group, so a group without a trainable parameter is empty and left out.

The wrapper hands the original, when the optimizer is Muon, ``model_parameters`` without the parameters that do not
require grad: the groups the original builds are then exactly upstream's. Other optimizers get ``model_parameters``
unchanged. One difference from upstream, in a log line only: DeepSpeed's check that every parameter has a
``use_muon`` tag (an error it logs, not raises) then looks at the trainable parameters only. Apply it before
``deepspeed.initialize``: the groups are built there.

The probe reads ``_configure_basic_optimizer``'s source: affected where its Muon branch builds a group with
``[p for p in model_parameters if p.use_muon]`` (or ``not p.use_muon``) and no ``requires_grad``; a release without
DeepSpeed's Muon (no ``MUON_OPTIMIZER`` branch) is not affected.
"""
from __future__ import annotations

import functools
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.runtime.engine", "DeepSpeedEngine._configure_basic_optimizer")
# A Muon group built from every parameter, frozen ones included: how affected releases split model_parameters.
_UNFILTERED_SPLIT = re.compile(r"\[\s*p\s+for\s+p\s+in\s+model_parameters\s+if\s+(not\s+)?p\.use_muon\s*\]")
_MUON = "muon"  # deepspeed.runtime.config.MUON_OPTIMIZER: the config's "type", lower-cased


class MuonFrozenParamsInGroups(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        source = _TARGET.source()
        if "MUON_OPTIMIZER" not in source:
            return Probe(False, "_configure_basic_optimizer has no Muon branch: DeepSpeed has no Muon of its own here "
                                "(the config's \"Muon\" is torch.optim.Muon)")
        if _UNFILTERED_SPLIT.search(source):
            return Probe(True, "_configure_basic_optimizer puts every parameter in Muon's groups by its use_muon tag "
                               "([p for p in model_parameters if p.use_muon]), frozen ones included")
        return Probe(False, "_configure_basic_optimizer builds Muon's groups from the parameters that require grad")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_trainable_only)]


def _trainable_only(original: Any) -> Any:
    @functools.wraps(original)
    def _configure_basic_optimizer(self, model_parameters):
        if self.optimizer_name() == _MUON:
            # upstream PR #7869: only parameters with requires_grad go into Muon's groups
            model_parameters = [p for p in model_parameters if getattr(p, "requires_grad", True)]
        return original(self, model_parameters)

    return _configure_basic_optimizer


FIX = MuonFrozenParamsInGroups()
