"""The opening of every entry's notebook: set up DeepSpeed, probe the installed code, check the
probe against the measured version matrix, and start the runner's record."""
from __future__ import annotations

from dataclasses import dataclass

import fixes
from fixes.fix import Fix, Probe

from .env import Environment, setup
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
