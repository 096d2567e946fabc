"""The README's two commands as a newcomer meets them: on a fresh clone of this checkout's last commit, with empty
pip, uv and user caches (no ``.venv``, ``.deepspeed``, ``.envs``, nothing downloaded before), and the operating
system's file cache emptied first (as root: ``sync; echo 3 > /proc/sys/vm/drop_caches``), as on a newly booted
machine: every read of torch, the venvs and the releases then comes from disk. Timed.

    python -m ci.bench --section clean --clean-mode main    # bash ci/setup.sh notebooks && bash ci/build.sh
    python -m ci.bench --section clean --clean-mode tests   # bash ci/setup.sh && .venv/bin/python -m pytest

The commands are read from README.md (its first two ``bash`` blocks), so the figure is of what the README says. The
record keeps the wall time, the exit status, the commit, the date and the machine's load (at the start, and the mean
of a sample every 15 s while it ran): on a shared machine the load says how much of the time was someone else's.
Each record also says whether the file cache was emptied (a run by a user who is not root keeps it, and says so) and how
much the command read from disk (``/proc/vmstat``'s ``pgpgin``). The figures go to ``ci/data/bench.json`` and the
Performance page (``python -m ci.bench --page``).
"""
from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from .. import ROOT

MODES = ("main", "tests")
SAMPLE_S = 15.0
# Where each part of a command ends, by the line it prints then: the set-up's last line, the runner's summary
# (the main job's notebooks), then the command's own end (the site; the tests).
PHASES: dict[str, tuple[tuple[str, str], ...]] = {
    "main": (("set-up", r"^fresh set-up \(\w+\) took "), ("notebooks", r"^\d+ passed, \d+ failed"), ("site", "")),
    "tests": (("set-up", r"^fresh set-up \(\w+\) took "), ("pytest", "")),
}


def phase_seconds(mode: str, lines: list[tuple[float, str]], total: float) -> dict[str, float]:
    """{phase: seconds} of ``mode``'s :data:`PHASES` from the command's output lines, each with the second it came
    (from the start); a phase whose end line never came is left out, and so is every one after it."""
    phases: dict[str, float] = {}
    start = 0.0
    for name, end_pattern in PHASES[mode]:
        if not end_pattern:
            phases[name] = round(total - start, 1)
            break
        end = next((at for at, line in lines if at >= start and re.search(end_pattern, line)), None)
        if end is None:
            break
        phases[name] = round(end - start, 1)
        start = end
    return phases


def readme_commands(readme: Path = ROOT / "README.md") -> dict[str, str]:
    """The main job's and the tests' commands, as README.md gives them (its first two ``bash`` code blocks)."""
    blocks = re.findall(r"```bash\n(.*?)```", readme.read_text(), flags=re.S)
    if len(blocks) < 2:
        raise ValueError(f"{readme.name} gives {len(blocks)} bash block(s); the main job's and the tests' are expected")
    return {"main": blocks[0].strip(), "tests": blocks[1].strip()}


class _LoadSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.samples.append(os.getloadavg()[0])


# What each command is meant to take from a clean machine (2 cores): the main job 6 minutes, the tests 20.
TARGET_SECONDS = {"main": 6 * 60, "tests": 20 * 60}
CACHES = ("pip", "uv", "user", "torch.compile")  # what clean_environment empties
EARLIER_CACHES = ("pip", "uv", "user")  # records made before torch.compile's cache was emptied too


def clean_environment(caches: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a clean machine's: nothing that points into the checkout's venv or selects a
    release, and every cache a run fills (pip's, uv's, the user's, where ccache and others keep theirs, and
    torch.compile's: Inductor's generated C++ and its builds, Triton's) an empty directory under ``caches``."""
    env = {key: value for key, value in (os.environ if environ is None else environ).items()
           if not key.startswith(("VIRTUAL_ENV", "FIXBOOK_", "PYTHONPATH", "UV_", "TORCHINDUCTOR_", "TRITON_"))}
    env.update({"PIP_CACHE_DIR": str(caches / "pip"), "UV_CACHE_DIR": str(caches / "uv"),
                "XDG_CACHE_HOME": str(caches / "xdg"), "TORCHINDUCTOR_CACHE_DIR": str(caches / "torchinductor"),
                "TRITON_CACHE_DIR": str(caches / "triton"), "PIP_NO_INPUT": "1"})
    return env


def drop_file_cache(control: Path = Path("/proc/sys/vm/drop_caches")) -> str:
    """Empty the operating system's file cache (page cache, dentries and inodes), as a newly booted machine has it:
    ``sync``, then ``3`` into ``control``. Returns ``"emptied"``, or ``"kept: WHY"`` where it cannot be done (not
    root; the file cannot be written), so a record never claims an empty cache it did not have."""
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        return "kept: not root"
    os.sync()
    try:
        control.write_text("3\n")
    except OSError as exc:
        return f"kept: {control} could not be written ({exc.strerror or exc})"
    return "emptied"


def disk_read_bytes(vmstat: Path = Path("/proc/vmstat")) -> int | None:
    """Bytes the machine has read from its block devices since boot (``pgpgin``, in KiB), or None where unknown."""
    try:
        for line in vmstat.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "pgpgin":
                return int(value) * 1024
    except (OSError, ValueError):
        return None
    return None


def cpu_times(stat: Path = Path("/proc/stat")) -> dict[str, float]:
    """The machine's CPU time so far, in CPU-seconds summed over its CPUs (``/proc/stat``'s first line): ``busy``
    (user, nice, system, irq, softirq), ``steal`` (time the hypervisor gave to other machines) and ``total``
    (everything, idle and I/O wait included); {} where there is no ``/proc/stat``."""
    try:
        fields = [int(value) for value in stat.read_text().splitlines()[0].split()[1:9]]
    except (OSError, IndexError, ValueError):
        return {}
    ticks = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
    user, nice, system, idle, iowait, irq, softirq, steal = fields
    return {"busy": (user + nice + system + irq + softirq) / ticks, "steal": steal / ticks,
            "total": sum(fields) / ticks}


def cpu_use(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the machine's CPUs did between two :func:`cpu_times`: ``cpu_busy`` the share of CPU time spent busy
    (by this command and anything else that ran), ``steal_s`` the CPU-seconds the hypervisor took away; {} where
    either reading is missing."""
    if not before or not after or after["total"] <= before["total"]:
        return {}
    return {"cpu_busy": round((after["busy"] - before["busy"]) / (after["total"] - before["total"]), 3),
            "steal_s": round(after["steal"] - before["steal"], 1)}


REFERENCE_LOOP = 10**7  # additions in reference_loop_seconds()


def reference_loop_seconds(n: int = REFERENCE_LOOP) -> float:
    """Seconds one core of this machine takes, now, for a fixed pure-Python loop of ``n`` additions. Measured at the
    start and at the end of each clean run: on a shared machine the same work takes longer while the host is busy,
    also where ``/proc/stat`` reports nothing stolen, and two runs of the same commit differ by that much."""
    started = time.perf_counter()
    total = 0
    for value in range(n):
        total += value
    return round(time.perf_counter() - started, 3)


def measure(mode: str, keep: bool = False) -> dict[str, Any]:
    """Clone this checkout's HEAD into a new directory and run ``mode``'s README command there with empty caches.
    Returns the record; the clone (and its caches) are removed unless ``keep`` or the command failed."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(MODES)}")
    command = readme_commands()[mode]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix=f"fixbook-clean-{mode}-"))
    clone = scratch / "fixbook"
    subprocess.run(["git", "clone", "--quiet", "--no-local", str(ROOT), str(clone)], check=True)
    env = clean_environment(scratch / "caches")
    log = scratch / "log.txt"
    reference_start = reference_loop_seconds()
    file_cache = drop_file_cache()
    read_start = disk_read_bytes()
    sampler = _LoadSampler()
    load_start = os.getloadavg()[0]
    cpu_start = cpu_times()
    started = time.monotonic()
    sampler.start()
    timed: list[tuple[float, str]] = []  # each output line, with the second it came
    try:
        with log.open("w") as out:
            proc = subprocess.Popen(["bash", "-c", command], cwd=clone, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace")
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                timed.append((time.monotonic() - started, line.rstrip("\n")))
            status = proc.wait()
    finally:
        sampler.done.set()
    seconds = time.monotonic() - started
    used = cpu_use(cpu_start, cpu_times())
    read_end = disk_read_bytes()
    used["reference_loop_s"] = [reference_start, reference_loop_seconds()]
    if read_start is not None and read_end is not None:
        used["disk_read_mib"] = round((read_end - read_start) / 2**20)
    tail = [line for _, line in timed[-3:]]
    record = {"command": command, "seconds": round(seconds, 1), "exit": status, "commit": commit,
              "date": datetime.date.today().isoformat(), "cpus": os.cpu_count(),
              "load_start": round(load_start, 1), "caches": list(CACHES), "file_cache": file_cache,
              "load_mean": round(sum(sampler.samples) / len(sampler.samples), 1) if sampler.samples else None,
              **used, "phases": phase_seconds(mode, timed, seconds), "last_lines": tail}
    if keep or status != 0:  # a failing run keeps its clone and log, to be read
        print(f"clean  {mode}: the clone and its log are kept in {scratch}")
    else:
        shutil.rmtree(scratch, ignore_errors=True)
    return record


def _minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {int(round(seconds % 60))} s"


def add_record(clean: dict[str, Any], mode: str, record: dict[str, Any]) -> None:
    """Keep ``record`` (:func:`measure`'s) in ``clean`` (``ci/data/bench.json``'s section): as ``mode``'s latest,
    and at the end of ``runs``, the list of every clean run ever recorded, which no later run replaces."""
    clean[mode] = record
    clean.setdefault("runs", []).append({"mode": mode, **{key: value for key, value in record.items()
                                                          if key != "last_lines"}})


def within_target(run: dict[str, Any]) -> bool:
    """Whether a recorded run ended well (exit 0) within its command's :data:`TARGET_SECONDS`."""
    return run["exit"] == 0 and run["seconds"] <= TARGET_SECONDS[run["mode"]]


def _machine_use(run: dict[str, Any]) -> str:
    if "cpu_busy" not in run:
        return "not recorded"
    loop = run.get("reference_loop_s")
    speed = f"; reference loop {loop[0]} s at the start, {loop[1]} s at the end" if loop else ""
    return f"{run['cpu_busy']:.0%} busy, {run['steal_s']} s stolen{speed}"


def _file_cache(run: dict[str, Any]) -> str:
    """The file cache's state at the start, and what the run read from disk (older records kept neither)."""
    if "file_cache" not in run:
        return "not recorded"
    read = f"; {run['disk_read_mib']} MiB read from disk" if "disk_read_mib" in run else ""
    return f"{run['file_cache']}{read}"


NAMES = {"main": "Main job (notebooks and site)", "tests": "Tests"}
SHORT_NAMES = {"main": "Main job", "tests": "Tests"}


def page_lines(clean: dict[str, Any]) -> list[str]:
    """The Performance page's section for the records of :func:`measure`: each command's latest run, then every
    run recorded (``runs``, :func:`add_record`) with how many ended within their target."""
    lines = ["## From a clean machine", "",
             "The README's two commands on a fresh clone, with the caches the table names empty: every download, every "
             "DeepSpeed wheel build, every environment the command sets up, every DeepSpeed op the tests build on "
             "first use (a fresh clone's releases have none built; ccache serves a release whose op sources another "
             "built), and where torch.compile's cache is among them every Inductor build, is part of the time "
             "(`python -m ci.bench --section clean --clean-mode main|tests`). The load average is the machine's, at "
             "the start and the mean while it ran.",
             "", "| Command | Wall time | Where it went | Exit | Commit | Date | CPUs | Empty caches | File cache | "
             "Load at start | Mean load |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        if mode in clean:
            r = clean[mode]
            where = ", ".join(f"{name} {seconds} s" for name, seconds in r.get("phases", {}).items()) or "not recorded"
            lines.append(f"| {NAMES[mode]}: `{r['command']}` | {_minutes(r['seconds'])} ({r['seconds']} s) | {where} | "
                         f"{r['exit']} | {r['commit']} | {r['date']} | {r['cpus']} | "
                         f"{', '.join(r.get('caches') or EARLIER_CACHES)} | {_file_cache(r)} | {r['load_start']} | "
                         f"{r['load_mean'] if r['load_mean'] is not None else 'not sampled'} |")
    lines.append("")
    runs = clean.get("runs", [])
    if runs:
        counts = "; ".join(f"{SHORT_NAMES[mode].lower()}: {sum(within_target(r) for r in of_mode)} of "
                           f"{len(of_mode)} within {_minutes(TARGET_SECONDS[mode])}"
                           for mode in MODES if (of_mode := [r for r in runs if r["mode"] == mode]))
        lines += ["### Every clean run", "",
                  "Every run recorded, oldest first (the table above shows the latest of each command). The targets "
                  f"on 2 CPUs: the main job within {TARGET_SECONDS['main'] // 60} minutes, the tests within "
                  f"{TARGET_SECONDS['tests'] // 60}. How much of the machine's CPU time "
                  "was busy (this command and anything else running) and how much the hypervisor took for other "
                  "machines (stolen) say how loaded the machine was; the reference loop (one core, "
                  f"{REFERENCE_LOOP:,} additions in Python, timed at the start and at the end) says how fast it was "
                  f"then. Within the target: {counts}.", "",
                  "| Command | Wall time | Within target | Exit | Commit | Date | Empty caches | File cache | "
                  "Load at start | Mean load | CPU time |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            lines.append(f"| {SHORT_NAMES[r['mode']]} | {_minutes(r['seconds'])} ({r['seconds']} s) | "
                         f"{'yes' if within_target(r) else 'no'} | {r['exit']} | {r['commit']} | {r['date']} | "
                         f"{', '.join(r.get('caches') or EARLIER_CACHES)} | {_file_cache(r)} | {r['load_start']} | "
                         f"{r['load_mean'] if r['load_mean'] is not None else 'not sampled'} | {_machine_use(r)} |")
        lines.append("")
    return lines
