"""The opening of every entry's notebook: set up DeepSpeed, probe the installed code, check the
probe against the measured version matrix, and start the runner's record."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import fixes
from fixes.fix import Fix, Probe

from .env import Environment, setup
from .launch import launch
from .report import Report


@dataclass
class Entry:
    fix: Fix
    env: Environment
    probe: Probe
    report: Report

    @property
    def affected(self) -> bool:
        return self.probe.affected


def begin(fix_id: str, results_file: str = "", seed: int = 0) -> Entry:
    """Set up, print the environment and the probe, and fail if the probe disagrees with what
    was measured for this release (then either the probe or the matrix is wrong).

    The matrix is measured on CPU (``DS_ACCELERATOR=cpu``). On another accelerator a probe may rightly
    disagree (a bug in DeepSpeed's CPU-only code path is not there on CUDA): the disagreement is printed, not
    raised, and the notebook's own assertions follow the probe."""
    fix = fixes.get(fix_id)
    env = setup(seed)
    print(env)
    probe = fix.probe()
    measured = fix.info.expected_affected(env.deepspeed)
    print(f"\nprobe of the installed code: affected={probe.affected} ({probe.evidence})")
    print(f"measured for DeepSpeed {env.deepspeed}: "
          f"{'not measured' if measured is None else 'affected' if measured else 'not affected'}")
    if measured is not None and measured != probe.affected:
        if env.accelerator == "cpu":
            raise AssertionError(f"the probe says affected={probe.affected} but DeepSpeed {env.deepspeed} was "
                                 f"measured affected={measured}")
        print(f"the probe on {env.accelerator} says affected={probe.affected}; the matrix was measured on CPU "
              f"(DS_ACCELERATOR=cpu). What follows is asserted for {env.accelerator}, as the probe says.")
    report = Report(fix.id, results_file)
    report.record_environment(env, probe.affected)
    return Entry(fix, env, probe, report)


def probe_in_rank(fix_id: str) -> dict[str, object]:
    """What a launched rank runs on and what ``fix_id``'s probe says there (run by :func:`probe_in_ranks`)."""
    from deepspeed.accelerator import get_accelerator

    return {"accelerator": get_accelerator().device_name(), "affected": fixes.get(fix_id).probe().affected}


def probe_in_ranks(entry: Entry, world_size: int = 2, timeout: float = 180.0) -> bool:
    """Whether ``world_size`` launched ranks have ``entry``'s bug, asked of the ranks themselves.

    The ranks may run elsewhere than the notebook: with fewer GPUs than ranks they run on CPU
    (:func:`fixes.harness.env.rank_placement`), where a CPU-only bug is there though the notebook's own probe
    on CUDA rightly says it is not. Fails if the ranks run where the notebook runs and their probe disagrees
    with the notebook's."""
    ranks = launch(probe_in_rank, world_size, entry.fix.id, timeout=timeout)
    print("the ranks:", ranks)
    affected = bool(ranks[0]["affected"])
    if ranks[0]["accelerator"] == entry.env.accelerator and affected != entry.probe.affected:
        raise AssertionError(f"the ranks' probe says affected={affected}, this process's {entry.probe.affected}, "
                             f"both on {entry.env.accelerator}")
    return affected


@contextlib.contextmanager
def fixed_where_installed(fix_id: str) -> Iterator[bool]:
    """Apply ``fix_id`` for the block where its bug is installed (its probe says so) and revert it after; a no-op
    elsewhere. Yields whether it applied it. For an entry whose bug another entry's bug hides: its measurement
    (``reproduce.measurement_context``) runs with that one fixed, as its fix ``requires``."""
    from .. import registry

    applied = registry.get(fix_id).is_affected() and registry.apply(fix_id)[0].action == "applied"
    try:
        yield applied
    finally:
        if applied:
            registry.revert(fix_id)
