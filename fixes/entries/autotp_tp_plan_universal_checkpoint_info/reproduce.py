"""How autotp-tp-plan-universal-checkpoint-info is reproduced: the fast check the release sweep runs (``reproduce()``:
True where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix
or its probe. The runs themselves are in ``tp_plan.py`` beside it."""
from __future__ import annotations

import importlib.util
from typing import Any

from ...exceptions import CannotTellError


def reads_tp_plan() -> bool:
    """Whether the installed DeepSpeed shards a model by its Hugging Face tp_plan at all
    (``deepspeed.module_inject.tp_plan_converter``). Where it does not, the plan is ignored (AutoTP's heuristics run
    instead) and no tp_plan route can drop anything."""
    return importlib.util.find_spec("deepspeed.module_inject.tp_plan_converter") is not None


def shows(job: Any, inject_missing_state: bool = False, world_size: int = 2) -> bool:
    """The user's job (:func:`.tp_plan.run`: train, save, ``ds_to_universal``, resume from the universal checkpoint
    in a fresh engine) on ``job``'s ranks: True if the conversion is refused for want of ``universal_checkpoint_info``
    or the resumed training ends away from plain PyTorch (``TOLERANCES``); False if it converts and resumes as plain
    PyTorch trains. ``world_size``: the ranks (2: one tensor-parallel group of two). CannotTellError where the
    conversion, the load or a rank fails otherwise."""
    from ...exceptions import RankFailedError
    from ...harness import compare
    from . import tp_plan as tp

    try:
        found = tp.run(job, tp.TP_PLAN, inject_missing_state, world_size=world_size)
    except RankFailedError as error:
        raise CannotTellError(f"the user's job failed before the check: {str(error).splitlines()[0][:300]}") from error
    if found.error:
        if found.bug:
            return True
        raise CannotTellError(f"the universal checkpoint could not be made: {found.error}")
    return not compare(found.weights, found.reference_weights, job.dtype, "resumed weights vs PyTorch").close


def reproduce() -> bool:
    """Two ranks, ``autotp_size`` 2, a model that declares transformers' Llama ``base_model_tp_plan`` for its MLP
    layers, ZeRO-1, Adam: two steps, ``save_checkpoint``, ``ds_to_universal`` (no flags). True if the conversion is
    refused for want of ``universal_checkpoint_info`` (or the resumed run leaves plain PyTorch). False on a release
    that does not read a model's tp_plan."""
    if not reads_tp_plan():
        return False
    from .tp_plan import autotp_job

    return shows(autotp_job())


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`shows`: the user's job on two ranks (the
    sweep's check), the same with ZeRO-2, the same converted with ``--inject_missing_state`` (converted, resumed from
    wrong row-parallel weights), then the use flipped: the same model sharded by a custom ``partition_config`` naming
    the same layers (which takes precedence over the plan: AutoTP's partition_config route, which attaches the info),
    and one rank with ``autotp_size`` 1 (nothing sharded). A checkpoint without tensor parallelism is a plain ZeRO
    checkpoint, which carries no ``universal_checkpoint_info`` on any release and which ds_to_universal converts with
    ``--inject_missing_state`` by design: that cell converts with the flag, as such a job must."""
    from ...harness import Cell, ds_config, trigger_job
    from .tp_plan import PARTITION_CONFIG, autotp_job

    def cell(label: str, job: Any, world_size: int = 2, flips: str = "", uses: tuple = ("autotp-tp-plan",),
             inject: bool = False) -> Cell:
        return Cell(label, trigger_job(ds_config(job, world_size), world_size, uses),
                    lambda: shows(job, inject, world_size), flips)

    return [cell("autotp_size 2, the model's tp_plan, ZeRO-1, fp32, ds_to_universal", autotp_job()),
            cell("ZeRO-2 instead", autotp_job(zero_stage=2)),
            cell("converted with --inject_missing_state", autotp_job(), inject=True),
            cell("the same layers sharded by a partition_config instead of the tp_plan",
                 autotp_job(partition_config=PARTITION_CONFIG), flips="uses:autotp-tp-plan", uses=()),
            cell("one rank, autotp_size 1 (converted with --inject_missing_state)", autotp_job(autotp_size=1),
                 world_size=1, flips="autotp_size|world_size", inject=True)]
