"""The trigger grids' shared pieces: a cell (one job around an entry's trigger, and how to tell whether the bug
shows in it) and the trigger's view of a harness job. An entry's ``reproduce.trigger_cells()`` returns its cells;
``python -m ci.sweep.triggers`` runs them on the entry's reproduce release and records where the bug showed."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

from ..trigger import Job as TriggerJob
from ..trigger import job_from_config
from .env import accelerator_name


@dataclass(frozen=True)
class Cell:
    """One job of a trigger grid. ``flips``: the condition (a :class:`~fixes.trigger.Condition`'s ``key``) this
    cell turns off, "" for the job that has them all. ``run()`` is True where the bug shows."""

    label: str
    job: TriggerJob
    run: Callable[[], bool]
    flips: str = ""


def trigger_job(job: Any = None, world_size: int = 1, uses: Iterable[str] = (), **changes: Any) -> TriggerJob:
    """The trigger's view of a harness :class:`~fixes.harness.Job` (its DeepSpeed config, as the harness builds it,
    on ``world_size`` ranks), or of a plain config dict; ``uses`` what the job does that the config cannot show;
    ``changes`` set fields the config does not carry (a torch version, say)."""
    import torch

    from .training import ds_config

    config = job if isinstance(job, dict) else ds_config(job, world_size) if job is not None else {}
    return job_from_config(config, world_size, list(uses), accelerator_name(), torch.__version__).with_(**changes)
