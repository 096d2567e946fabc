"""Benchmark: ``fixbook doctor`` against a bare ``import deepspeed``, in fresh processes.

    python -m ci.bench.doctor                      # the newest release and the oldest of the set, 5 rounds
    python -m ci.bench.doctor --release 0.18.2 --rounds 9

Each round runs both commands once, alternating, so machine load affects both alike. Prints the
median wall time of each and their ratio (the target is about 1.5x or less: the doctor's work on
top of importing DeepSpeed is reading the sweep file and probing code objects, no training).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from .. import releases as release_env

COMMANDS = {
    "import deepspeed": ["-c", "import deepspeed"],
    "fixbook doctor": ["-m", "fixes.cli", "doctor"],
}


def wall(release: str, args: list[str]) -> float:
    env = {**os.environ, **release_env.environment(release), "DS_ACCELERATOR": "cpu"}
    started = time.perf_counter()
    subprocess.run([sys.executable, *args], env=env, check=True, capture_output=True, cwd=release_env.ROOT)
    return time.perf_counter() - started


def bench(release: str, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    wall(release, COMMANDS["import deepspeed"])  # warm the file cache once, uncounted
    for _ in range(rounds):
        for name, args in COMMANDS.items():
            times[name].append(wall(release, args))
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.bench.doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--release", action="append", help="release (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    known = release_env.load()
    for release in args.release or [known.releases[0], known.newest]:
        times = bench(release, args.rounds)
        base, doctor = (statistics.median(times[name]) for name in COMMANDS)
        print(f"DeepSpeed {release}: import deepspeed {base:.2f} s, fixbook doctor {doctor:.2f} s "
              f"(medians of {args.rounds}), ratio {doctor / base:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
