"""What ``bash ci/setup.sh`` will do, and how long it took last time, said before it starts.

    python3 ci/releases/setup_plan.py plan [all|notebooks|matrix]  # printed by ci/setup.sh first
    python3 ci/releases/setup_plan.py record MODE SECONDS          # ci/setup.sh, at the end of a set-up that started fresh

Stdlib only: it runs before the project venv exists. The figures come from ``ci/data/setup.json``, which a set-up that
began with no ``.venv`` writes (its mode, wall time, the machine's load, the size of what it made): a plan never
types a size or a time by hand.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # ci/releases/setup_plan.py -> the checkout
RECORD = ROOT / "ci" / "data" / "setup.json"
MODES = {"all": "what the tests need: the main job's set, the sweep's boundary releases, the environments the tests "
                "use (ci/environments.toml) and Chromium",
         "notebooks": "what the main job needs (ci/build.sh): the project venv and the release set",
         "matrix": "the notebooks' whole matrix (ci/build.sh --env all): the main job's set and the other environments"}


def _gib(size: float) -> str:
    return f"{size / 2**30:.1f} GiB"


def _du(path: Path) -> int:
    if not path.exists():
        return 0
    done = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout else 0


def plan(mode: str) -> str:
    releases = tomllib.loads((ROOT / "ci" / "releases.toml").read_text())
    environments = tomllib.loads((ROOT / "ci" / "environments.toml").read_text())
    recorded = json.loads(RECORD.read_text()).get(mode) if RECORD.exists() else None
    lines = [f"ci/setup.sh {mode}: {MODES[mode]}.", "It will make:",
             f"  .venv          Python {sys.version_info.major}.{sys.version_info.minor} with torch {releases['torch']} "
             "(the CPU wheel on local disk) and ci/requirements.txt (Jupyter, papermill, mkdocs, pytest, ...)",
             f"  .deepspeed/    DeepSpeed {', '.join(releases['releases'])} side by side"
             + (" and the sweep's boundary releases" if mode == "all" else "") + ", one Jupyter kernel each"]
    for name, env in environments.items() if mode != "notebooks" else ():
        if mode == "all" and not env.get("tests"):
            continue  # built by `ci/setup.sh matrix` only
        lines.append(f"  .envs/{name + ' ':<13}Python {env['python']} with torch {env['torch']} from PyPI (CUDA build, run on CPU)")
    lines.append("  and Debian's " + ("chromium for the site's browser test and " if mode == "all" else "")
                 + "ccache, through which DeepSpeed's JIT ops compile, and numactl, which DeepSpeed 0.14.4 - 0.15.x's "
                 "CPU accelerator runs (apt, as root)")
    free = shutil.disk_usage(ROOT).free
    if recorded:
        sizes = recorded["sizes"]
        lines.append(f"Last measured ({recorded['date']}, a fresh set-up, load average {recorded['load']} at the start): "
                     f"{recorded['seconds'] / 60:.1f} min; it made {_gib(sum(sizes.values()))} on disk ("
                     + ", ".join(f"{path} {_gib(size)}" for path, size in sizes.items()) + f"); {_gib(free)} free now.")
        if sum(sizes.values()) > free:
            lines.append("WARNING: that is more than this disk has free.")
    else:
        lines.append(f"No earlier fresh set-up is recorded here for a time or size; {_gib(free)} free now.")
    lines.append("Idempotent: a second run only checks and adds what is missing.")
    return "\n".join(lines)


def record(mode: str, seconds: float, load: str) -> None:
    """Keep this fresh set-up's figures for the next plan: wall time, load at the start, and the size of each thing
    it made."""
    paths = [ROOT / ".venv", ROOT / ".deepspeed", *sorted((ROOT / ".envs").glob("*"))]
    data = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    data[mode] = {"date": time.strftime("%Y-%m-%d"), "seconds": round(seconds), "load": load,
                  "sizes": {str(path.relative_to(ROOT)): _du(path) for path in paths if path.is_dir()}}
    RECORD.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str]) -> int:
    if len(argv) >= 1 and argv[0] == "plan" and len(argv) <= 2 and (argv[1:] or ["all"])[0] in MODES:
        print(plan((argv[1:] or ["all"])[0]))
        return 0
    if len(argv) == 4 and argv[0] == "record" and argv[1] in MODES:
        record(argv[1], float(argv[2]), argv[3])
        return 0
    print("usage: python3 ci/releases/setup_plan.py plan [all|notebooks|matrix] | record MODE SECONDS LOAD", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
