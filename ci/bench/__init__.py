"""Benchmarks: what a fix costs at training time, and what the tools cost. Prints figures, asserts nothing.

    python -m ci.bench                       # every section, 5 rounds; writes ci/data/bench.json
    python -m ci.bench --section overhead --rounds 7
    python -m ci.bench --section notebooks --entry zero2-offload-multi-backward

Sections (medians of ``--rounds`` repetitions, each repetition alternating what it compares, so
machine load affects both sides alike):

* ``overhead`` — for every entry whose ``reproduce.py`` defines ``bench_job()`` (its fix touches the
  training path): the median step time of that job with the fix applied on the entry's reproduce
  release, against the same job on the first release upstream fixed it (``upstream_fixed_in``), or,
  for a bug still open upstream, on the same release unpatched. The job uses a model big enough that
  a step takes tens of milliseconds on a CPU, so the fix's own cost is not lost in noise.
* ``notebooks`` — per notebook on its reproduce release: papermill (its kernel forked from a warm kernel
  server, as the runner runs it, and a new Python per kernel) against the same code cells run as one
  plain script with the same Python, and the script's interpreter start and ``import deepspeed``; and
  the runner's serial, ``--jobs 2`` and ``--jobs 2`` with new kernel processes wall times.
* ``breakdown`` — where each notebook's time goes: imports, engine builds, rank launches and the rest, timed
  inside its cells run as a script, and papermill's kernel start (``ci/bench/breakdown.py``).
* ``launch`` — ranks forked from a preloaded server against spawned.
* ``cli`` — ``fixbook doctor`` against a bare ``import deepspeed``; ``fixbook search`` latency.
* ``differential`` — the differential sweep's cost, read from its record (``ci/bench/differential.py``).
* ``differential-parts`` — the differential sweep's four matrix parts run here end to end (never part of a whole run).
* ``site`` — ``mkdocs build --strict`` over the generated pages (``python -m ci.site`` first, from the notebook
  runs in ``build/``), and the size of the search index it writes, in all and per entry page.

The figures land in ``ci/data/bench.json`` with the machine and the date; ``python -m ci.bench
--page`` turns that file into ``docs/performance.md``.

Package ``ci.bench``: benchmarks, the highest of the flow's packages. The sections (here), where a
notebook's time goes (``breakdown.py``), ``fixbook doctor``'s cost (``doctor.py``: ``python -m ci.bench.doctor``),
the scripts they time (``scripts.py``), the clean-machine timer (``clean_machine.py``) and the search's figures
(``search_eval.py``: ``python -m ci.bench.search_eval``).
May import: every ci package but ``ci.tools``, and ``fixes``.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import ROOT
from . import clean_machine
from .. import releases as release_env
from .scripts import machine, notebook_script, script_command, tiny_notebook

RESULTS = ROOT / "ci" / "data" / "bench.json"  # the record the Performance page is written from (committed)
PAGE = ROOT / "docs" / "performance.md"


# ---- overhead ------------------------------------------------------------------------------------

def _reproduce(entry: str) -> Any:
    """The entry's ``fixes.entries.<entry>.reproduce`` module (its jobs: ``bench_job``, ``bench_baseline_job``)."""
    return importlib.import_module(f"fixes.entries.{entry.replace('-', '_')}.reproduce")


def _child_step_times(entry: str, apply_fix: bool, steps: int, job_name: str = "bench_job") -> None:
    """In a release's child process: the entry's bench job (``reproduce.<job_name>()``), ``steps`` timed
    steps after a warm-up."""
    import fixes
    from fixes import harness
    from fixes.harness.training import _backward

    harness.setup()
    job = getattr(_reproduce(entry), job_name)()
    if apply_fix:
        fixes.apply(entry)
    engine = harness.build_engine(job)
    batches = harness.make_batches(job.model, steps + 3, job.micro_batches_per_step, 1, job.micro_batch)
    times = []
    for step in range(steps + 3):
        started = time.perf_counter()
        for micro in range(job.micro_batches_per_step):
            x, y = batches.micro(step, micro, 0)
            if job.backwards > 1:
                engine.set_gradient_accumulation_boundary(micro == job.backwards - 1)
            _backward(engine, job.backward, engine(x.to(harness.device(), harness.dtype_of(job.dtype))),
                      y.to(harness.device()))
            if job.backwards == 1 or micro == job.backwards - 1:
                engine.step()
        if step >= 3:  # warm-up steps are not counted
            times.append(time.perf_counter() - started)
    print("BENCH" + json.dumps({"median_s": statistics.median(times), "steps": steps,
                                "applied": [f.id for f in fixes.all_fixes() if f.applied]}))


def _step_time(entry: str, release: str, apply_fix: bool, steps: int, job_name: str = "bench_job") -> float:
    code = (f"from ci.bench import _child_step_times; "
            f"_child_step_times({entry!r}, {apply_fix!r}, {steps!r}, {job_name!r})")
    release_env.install(release)  # a swept release outside the set (an upstream-fixed baseline): installed once
    done = release_env.run_python_any(release, ["-c", code], timeout=900, capture_output=True, text=True,
                                      extra_env={"DS_ACCELERATOR": "cpu"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{entry} on {release} (fix {'on' if apply_fix else 'off'}) failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1][5:])["median_s"]


def bench_entries() -> list[str]:
    """Entries whose reproduction defines ``bench_job()``: their fix is on the training path."""
    import fixes

    found = []
    for fix in fixes.all_fixes():
        if hasattr(_reproduce(fix.id), "bench_job"):
            found.append(fix.id)
    return found


def _spread(ratios: list[float]) -> list[float]:
    """[lowest, highest] of the per-round ratios, as recorded."""
    return [round(min(ratios), 3), round(max(ratios), 3)]


def _spread_text(spread: list[float] | None) -> str:
    return f"{spread[0]:.3f}-{spread[1]:.3f}" if spread else ""


def overhead(rounds: int, entries: list[str] | None, steps: int) -> list[dict[str, Any]]:
    """Per entry: the fix's job against its baseline, ``rounds`` times, the two alternating. An entry whose
    ``reproduce.py`` also defines ``bench_baseline_job()`` (the same computation through DeepSpeed's own
    API, on the same release, no fix) gets a third figure: the fix's cost with the release held equal."""
    import fixes

    from fixes import measured

    rows = []
    known = measured.load().releases  # every swept release: the upstream-fixed one may be outside the set
    for entry in entries or bench_entries():
        info = fixes.get(entry).info
        release = info.reproduce_release
        upstream = info.upstream_fixed_in if info.upstream_fixed_in in known else None
        baseline = upstream or release
        same = hasattr(_reproduce(entry), "bench_baseline_job")
        fixed_times, base_times, same_times = [], [], []
        load = round(os.getloadavg()[0], 1)
        for _ in range(rounds):
            fixed_times.append(_step_time(entry, release, True, steps))
            base_times.append(_step_time(entry, baseline, False, steps))
            if same:
                same_times.append(_step_time(entry, release, False, steps, "bench_baseline_job"))
        fixed, base = statistics.median(fixed_times), statistics.median(base_times)
        ratios = [f / b for f, b in zip(fixed_times, base_times)]
        row = {"entry": entry, "release": release, "fixed_ms": round(fixed * 1e3, 2),
               "baseline": f"{baseline} (upstream fixed)" if upstream else f"{release} unpatched",
               "baseline_ms": round(base * 1e3, 2), "ratio": round(fixed / base, 3), "round_ratios": _spread(ratios),
               "rounds": rounds, "load_average": load}
        line = (f"overhead  {entry:<34} fix on {release}: {fixed * 1e3:7.1f} ms/step; {row['baseline']}: "
                f"{base * 1e3:7.1f} ms/step; ratio {fixed / base:.3f} (rounds {_spread_text(row['round_ratios'])})")
        if same:
            same_median = statistics.median(same_times)
            row.update(same_release_ms=round(same_median * 1e3, 2), same_release_ratio=round(fixed / same_median, 3),
                       same_release_round_ratios=_spread([f / b for f, b in zip(fixed_times, same_times)]))
            line += (f"; {release} without the fix, same computation: {same_median * 1e3:7.1f} ms/step, ratio "
                     f"{row['same_release_ratio']:.3f} (rounds {_spread_text(row['same_release_round_ratios'])})")
        rows.append(row)
        print(line, flush=True)
    return rows


# ---- notebooks -----------------------------------------------------------------------------------

def _timed(args: list[str], release: str) -> float:
    started = time.perf_counter()
    done = release_env.run_python(release, args, timeout=900, capture_output=True, text=True,
                                  extra_env={"DS_ACCELERATOR": "cpu"})
    if done.returncode != 0:
        raise RuntimeError(f"{args} on {release} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def _papermill_s(entry: str, release: str, scratch: str) -> float:
    from ..notebooks import runner

    started = time.perf_counter()
    result = runner.execute(runner.notebook_path(entry), Path(scratch) / "out.ipynb", release_env.kernel_name(release),
                            {"results_file": ""}, 600, entry, release)
    if not result.passed:
        raise RuntimeError(f"{entry} failed under papermill: {result.error}")
    return time.perf_counter() - started


def notebooks(rounds: int, entries: list[str] | None, matrix_runs: bool = True) -> dict[str, Any]:
    """Per notebook: papermill with its kernel forked from a warm kernel server (``ci.processes.kernels``, as the runner
    runs it), papermill with a new Python per kernel (``FIXBOOK_FORK_KERNELS=0``, as before), and the same
    cells as one plain script; then the runner over the chosen entries' matrix serial and with ``--jobs 2``,
    and with ``--jobs 2`` and a new Python per kernel (unless ``matrix_runs`` is false)."""
    import fixes

    from ..processes import kernels
    from ..notebooks import runner

    rows = []
    chosen = entries or fixes.available()
    idle_before = os.environ.get(kernels.IDLE_VARIABLE)
    os.environ[kernels.IDLE_VARIABLE] = "3600"  # a server stays warm between the rounds
    try:
        for entry in chosen:
            release = fixes.get(entry).info.reproduce_release
            with tempfile.TemporaryDirectory() as scratch, kernels.servers() as servers:
                script = Path(scratch) / f"{entry}.py"
                script.write_text(notebook_script(runner.notebook_path(entry), {"results_file": ""}))
                warm = runner.execute(tiny_notebook(Path(scratch) / "warm.ipynb", release_env.kernel_name(release)),
                                      Path(scratch) / "warm-out.ipynb", release_env.kernel_name(release), {}, 600)
                if not warm.passed or servers is None:
                    raise RuntimeError(f"no kernel server for {release}: {warm.error or kernels.enabled()[1]}")
                forked, fresh, plain, start, imports = [], [], [], [], []
                for _ in range(rounds):
                    forked.append(_papermill_s(entry, release, scratch))
                    directory = os.environ.pop(kernels.DIR_VARIABLE)  # this run's kernel: a new Python
                    try:
                        fresh.append(_papermill_s(entry, release, scratch))
                    finally:
                        os.environ[kernels.DIR_VARIABLE] = directory
                    plain.append(_timed(script_command(script), release))
                    start.append(_timed(["-c", "pass"], release))
                    imports.append(_timed(["-c", "import deepspeed"], release))
            row = {"entry": entry, "release": release, "papermill_s": round(statistics.median(forked), 1),
                   "papermill_new_kernel_s": round(statistics.median(fresh), 1),
                   "script_s": round(statistics.median(plain), 1), "python_start_s": round(statistics.median(start), 2),
                   "import_deepspeed_s": round(statistics.median(imports) - statistics.median(start), 2)}
            row["ratio"] = round(row["papermill_s"] / row["script_s"], 2)
            row["ratio_new_kernel"] = round(row["papermill_new_kernel_s"] / row["script_s"], 2)
            rows.append(row)
            print(f"notebook  {entry:<34} papermill {row['papermill_s']:6.1f} s (new kernel process "
                  f"{row['papermill_new_kernel_s']:6.1f} s), script {row['script_s']:6.1f} s (ratio {row['ratio']:.2f}, "
                  f"new kernel {row['ratio_new_kernel']:.2f}; python start {row['python_start_s']:.2f} s, import deepspeed "
                  f"{row['import_deepspeed_s']:.2f} s)", flush=True)
    finally:  # as it was, also when a notebook failed
        if idle_before is None:
            os.environ.pop(kernels.IDLE_VARIABLE, None)
        else:
            os.environ[kernels.IDLE_VARIABLE] = idle_before
    if not matrix_runs:
        return {"per_notebook": rows, "matrix": None, "rounds": rounds, "machine": machine()}
    matrix = {"runs": len(runner.matrix(chosen))}
    for key, jobs, fork in (("jobs_1_s", 1, "1"), ("jobs_2_s", 2, "1"), ("jobs_2_new_kernels_s", 2, "0")):
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "ci.notebooks.runner", "--jobs", str(jobs), "--build", scratch,
                                   *[arg for entry in chosen for arg in ("--entry", entry)]],
                                  cwd=ROOT, capture_output=True, text=True, timeout=3600,
                                  env={**os.environ, "FIXBOOK_FORK_KERNELS": fork})
            matrix[key] = round(time.perf_counter() - started, 1)
            if done.returncode != 0:
                raise RuntimeError(f"runner --jobs {jobs} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        print(f"matrix    {matrix['runs']} runs, --jobs {jobs}{'' if fork == '1' else ', new kernel processes'}: "
              f"{matrix[key]:.0f} s", flush=True)
    return {"per_notebook": rows, "matrix": matrix, "rounds": rounds, "machine": machine()}


# ---- launch --------------------------------------------------------------------------------------

LAUNCH_ENTRIES = ("zero12-flat-buffer-detach", "pipeline-nested-backward", "zero3-hooks-torch-func",
                  "zero3-gathered-params-cpu-race", "engine-tensor-backward")  # the notebooks that launch ranks most


def _child_launch_times(launches: int) -> None:
    """In a release's child process: ``launches`` two-rank launches of a small ZeRO-2 job, each timed."""
    from fixes import harness

    harness.setup()
    job = harness.Job(zero_stage=2, micro_steps=2)
    times = []
    for _ in range(launches):
        started = time.perf_counter()
        harness.launch(harness.run_job, 2, job, timeout=300)
        times.append(time.perf_counter() - started)
    print("BENCH" + json.dumps(times))


def _child_check_times(rounds: int) -> None:
    """In a release's child process: ``fixes.check(engine)`` on a small ZeRO-2 engine, the first call (it loads the
    triggers and the measured matrix) and ``rounds`` more, each timed."""
    import warnings

    import fixes
    from fixes import harness

    harness.setup()
    engine = harness.build_engine(harness.Job(zero_stage=2, micro_steps=2))
    fixes.all_fixes()  # what `import fixes; fixes.apply()` has loaded before a job checks itself
    times = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(rounds + 1):
            started = time.perf_counter()
            fixes.check(engine)
            times.append(time.perf_counter() - started)
    print("BENCH" + json.dumps(times))


def check(rounds: int) -> dict[str, Any]:
    """``fixes.check(engine)``'s cost after ``deepspeed.initialize`` (issue goal: under 10 ms), as a user's job meets
    it: the package byte-compiled as pip installs it, its registry loaded (``fixes.apply()`` loads it)."""
    import compileall

    release = release_env.load().newest
    compileall.compile_dir(str(ROOT / "fixes"), quiet=1)
    done = release_env.run_python_any(release, ["-c", f"from ci.bench import _child_check_times; "
                                                      f"_child_check_times({max(rounds, 20)})"],
                                      timeout=600, capture_output=True, text=True,
                                      extra_env={"DS_ACCELERATOR": "cpu", "PYTHONDONTWRITEBYTECODE": ""})
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"check failed:\n{done.stderr[-2000:]}")
    times = json.loads(lines[-1][5:])
    row = {"release": release, "first_ms": round(times[0] * 1e3, 2), "median_ms": round(statistics.median(times[1:]) * 1e3, 2),
           "calls": len(times) - 1, "machine": machine()}
    print(f"check     fixes.check(engine), DeepSpeed {release}: first call {row['first_ms']} ms, then median "
          f"{row['median_ms']} ms over {row['calls']}", flush=True)
    return row


def launch(rounds: int, entries: list[str] | None) -> dict[str, Any]:
    """How ranks start (:func:`fixes.harness.launch.start_method`): forked from a preloaded server against
    spawned (``FIXBOOK_START_METHOD=spawn``), for one two-rank launch and for the notebooks that launch most."""
    import fixes

    from ..notebooks import runner

    release = release_env.load().newest
    rows: dict[str, Any] = {"release": release, "launches": rounds}
    for method in ("spawn", "forkserver"):
        extra = {"DS_ACCELERATOR": "cpu", "FIXBOOK_START_METHOD": method}
        done = release_env.run_python_any(release, ["-c", f"from ci.bench import _child_launch_times; "
                                                          f"_child_launch_times({rounds + 1})"],
                                          timeout=1800, capture_output=True, text=True, extra_env=extra)
        lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"launch ({method}) failed:\n{done.stderr[-2000:]}")
        times = json.loads(lines[-1][5:])
        rows[f"{method}_first_s"] = round(times[0], 2)
        rows[f"{method}_s"] = round(statistics.median(times[1:]), 2)
        print(f"launch    {method:<10} two ranks, small ZeRO-2 job, DeepSpeed {release}: first {times[0]:.2f} s, "
              f"then median {rows[f'{method}_s']:.2f} s over {rounds}", flush=True)
    chosen = entries or [entry for entry in LAUNCH_ENTRIES if entry in fixes.available()]
    notebooks_s: dict[str, dict[str, float]] = {}
    for method in ("spawn", "forkserver"):
        with tempfile.TemporaryDirectory() as scratch:
            done = subprocess.run([sys.executable, "-m", "ci.notebooks.runner", "--release", release, "--env", "cpu",
                                   "--build", scratch, *[arg for entry in chosen for arg in ("--entry", entry)]],
                                  cwd=ROOT, capture_output=True, text=True, timeout=3600,
                                  env={**os.environ, "FIXBOOK_START_METHOD": method})
            if done.returncode != 0:
                raise RuntimeError(f"runner ({method}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
            notebooks_s[method] = {r.entry: round(r.wall_s, 1) for r in runner.recorded_runs(Path(scratch))}
        print(f"launch    {method:<10} {len(chosen)} notebooks on {release}: {sum(notebooks_s[method].values()):.0f} s "
              f"({notebooks_s[method]})", flush=True)
    rows["notebooks"] = [{"entry": entry, "spawn_s": notebooks_s["spawn"][entry],
                          "forkserver_s": notebooks_s["forkserver"][entry]} for entry in chosen]
    rows["machine"] = machine()
    return rows


# ---- cli -----------------------------------------------------------------------------------------

def cli(rounds: int) -> dict[str, Any]:
    from .doctor import bench as doctor_bench

    from fixes.cli import search

    release = release_env.load().newest
    times = doctor_bench(release, rounds)
    base, doctor = (statistics.median(v) for v in times.values())
    query = Path(ROOT / "tests" / "fixes" / "data" / "search_queries.json")
    queries = [q["query"] for q in json.loads(query.read_text())] if query.exists() else ["KeyError: 0"]
    search(queries[0])  # warm the registry once
    started = time.perf_counter()
    for text in queries:
        search(text, release)
    per_query = (time.perf_counter() - started) / len(queries)
    from . import search_eval

    reports = [r["text"] for r in json.loads(search_eval.REPORTS.read_text())["reports"]]
    median_ms = statistics.median(search_eval.query_times_ms(queries + reports))
    parts = search_eval.evaluate()
    row = {"release": release, "import_deepspeed_s": round(base, 2), "doctor_s": round(doctor, 2),
           "doctor_ratio": round(doctor / base, 2), "search_ms_per_query": round(per_query * 1e3, 2),
           "queries": len(queries), "search_median_ms": round(median_ms, 2), "search_timed": len(queries + reports),
           "reports": {name: {"right": f.right, "reports": f.reports, "strong_negatives": f.strong_negatives,
                              "negatives": f.negatives} for name, f in parts.items()}}
    print(f"search    median {median_ms:.2f} ms per query over {len(queries + reports)}; "
          + "; ".join(f.line(name) for name, f in parts.items()), flush=True)
    print(f"cli       DeepSpeed {release}: import deepspeed {base:.2f} s, fixbook doctor {doctor:.2f} s "
          f"(ratio {doctor / base:.2f}); fixbook search {per_query * 1e3:.2f} ms per query over {len(queries)}",
          flush=True)
    return row


# ---- site ----------------------------------------------------------------------------------------

def index_sizes(index: dict[str, Any]) -> dict[str, int]:
    """Bytes of the search index (``search_index.json``'s ``docs``, JSON-encoded as mkdocs writes them) per entry
    page, keyed by entry id: every section of ``generated/entries/<id>/``."""
    sizes: dict[str, int] = {}
    for doc in index["docs"]:
        parts = doc["location"].split("#")[0].strip("/").split("/")
        if len(parts) == 3 and parts[:2] == ["generated", "entries"]:
            sizes[parts[2]] = sizes.get(parts[2], 0) + len(json.dumps(doc))
    return sizes


def site(rounds: int, build: Path | None = None) -> dict[str, Any]:
    """``python -m ci.site`` once, then ``mkdocs build --strict`` ``rounds`` times into a scratch directory (median
    wall time), and the search index of the last build: its size in all and per entry page. Needs the notebook
    runs in ``build/`` (``bash ci/build.sh``, or ``python -m ci.notebooks.runner``); fails naming what is missing."""
    import shutil

    build = build or ROOT / "build"
    if not (build / "results").is_dir():
        raise RuntimeError(f"no notebook runs in {build / 'results'}: run `bash ci/build.sh` (or python -m ci.notebooks.runner) first")
    where = machine()  # the load average when it starts
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ci.site"], cwd=ROOT, check=True, capture_output=True)
    generate_s = time.perf_counter() - started
    mkdocs = str(Path(sys.executable).parent / "mkdocs")
    times = []
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(rounds):
            shutil.rmtree(Path(scratch) / "site", ignore_errors=True)
            started = time.perf_counter()
            subprocess.run([mkdocs, "build", "--strict", "--quiet", "-d", str(Path(scratch) / "site")], cwd=ROOT,
                           check=True, capture_output=True)
            times.append(time.perf_counter() - started)
        index_path = Path(scratch) / "site" / "search" / "search_index.json"
        total = index_path.stat().st_size
        per_entry = index_sizes(json.loads(index_path.read_text()))
    row = {"generate_s": round(generate_s, 2), "mkdocs_build_s": round(statistics.median(times), 2), "rounds": rounds,
           "index_bytes": total, "entries": len(per_entry),
           "index_bytes_per_entry": round(sum(per_entry.values()) / max(len(per_entry), 1)),
           "largest": sorted(per_entry.items(), key=lambda kv: -kv[1])[:3], "machine": where}
    print(f"site      python -m ci.site {generate_s:.2f} s; mkdocs build --strict {row['mkdocs_build_s']} s (median of "
          f"{rounds}); search index {total} bytes, entry pages {row['index_bytes_per_entry']} bytes each on average over "
          f"{len(per_entry)}", flush=True)
    return row


def _above_goal(row: dict[str, Any]) -> str:
    """``entry (ratio)``, and whether its rounds reach below 1.0 (then the median is within the noise)."""
    same = "same_release_ratio" in row
    ratio = row["same_release_ratio"] if same else row["ratio"]
    spread = row.get("same_release_round_ratios" if same else "round_ratios")
    low = spread[0] if spread else None
    noise = f"; its rounds reach {low:.3f}, within this machine's noise" if low is not None and low < 1.0 else ""
    return f"{row['entry']} ({ratio}{noise})"


def _baseline_text(entry: str) -> str:
    """The first line of the entry's ``bench_baseline_job`` docstring, as Markdown."""
    doc = (getattr(_reproduce(entry), "bench_baseline_job", None).__doc__ or "").strip().splitlines()
    return doc[0].replace("``", "`") if doc else ""


def page(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = ["# Performance", "",
             f"Measured by `python -m ci.bench` on {m['date']}: {m['cpus']} CPUs ({m['processor']}), Python "
             f"{m['python']}, no GPU. Other jobs may share these cores: ratios compare runs made side by side, absolute "
             "times are not a benchmark of the CPU; each section gives its rounds (medians) and the load average when "
             "it started, where the run recorded them. Every figure below is printed by that "
             "command and copied here from `ci/data/bench.json` by `python -m ci.bench --page`.", ""]
    if results.get("overhead"):
        lines += ["## What a fix costs per training step", "",
                  "The entry's bench job (`reproduce.bench_job()`, on the shared bench model) with the fix applied, "
                  "against the same job where upstream fixed it, or unpatched where upstream has not. Across releases "
                  "more than the fix differs, so a ratio is an upper bound on the fix's cost only where the baseline is "
                  "the same release.", "",
                  "| Entry | Fix applied on | ms/step | Baseline | ms/step | Ratio | Per round | Rounds | Load |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['entry']} | {r['release']} | {r['fixed_ms']} | {r['baseline']} | {r['baseline_ms']} | "
                  f"{r['ratio']} | {_spread_text(r.get('round_ratios'))} | {r.get('rounds', 'not recorded')} | "
                  f"{r.get('load_average', 'not recorded')} |" for r in results["overhead"]]
        lines += ["", "*Per round*: the lowest and highest ratio of the rounds (each round runs both sides, one after "
                  "the other); a median above 1.02 whose rounds reach below 1.0 is within this machine's noise."]
        for r in results["overhead"]:
            if "same_release_ratio" in r:
                lines += ["", f"**{r['entry']}, the release held equal.** {_baseline_text(r['entry'])} On "
                          f"{r['release']} without the fix: {r['same_release_ms']} ms/step; the fix's job against it: "
                          f"ratio {r['same_release_ratio']} (per round {_spread_text(r['same_release_round_ratios'])})."]
        above = [r for r in results["overhead"] if r.get("same_release_ratio", r["ratio"]) > 1.02]
        if above:
            lines += ["", "Above the 1.02 goal: " + ", ".join(_above_goal(r) for r in above) + "."]
        lines.append("")
    if results.get("notebooks"):
        nb = results["notebooks"]
        where = nb.get("machine", {})
        lines += ["## Running the notebooks", "",
                  "The runner forks each notebook's kernel from a kernel server that imported torch and DeepSpeed "
                  "once (`ci/processes/kernels.py`; also torch._dynamo and Inductor, which DeepSpeed 0.19.8 defers to the first "
                  "engine build; then `gc.freeze()`), and the kernel's server for ranks and resource tracker with it; "
                  "a new Python per kernel (`FIXBOOK_FORK_KERNELS=0`) imports them again, and spawns both. "
                  f"Medians of {nb.get('rounds', '(rounds not recorded)')} round(s), measured on "
                  f"{where.get('date', '(date not recorded)')}; load average "
                  f"{where.get('load_average', '(not recorded)')} when it started.", "",
                  "| Notebook | Release | papermill s | papermill, new kernel process s | plain script s | ratio | "
                  "ratio, new kernel process | python start s | import deepspeed s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['entry']} | {r['release']} | {r['papermill_s']} | {r.get('papermill_new_kernel_s', 'not measured')} | "
                  f"{r['script_s']} | {r['ratio']} | {r.get('ratio_new_kernel', 'not measured')} | "
                  f"{r['python_start_s']} | {r['import_deepspeed_s']} |" for r in nb["per_notebook"]]
        slow = [r for r in nb["per_notebook"] if r["ratio"] > 1.3]
        slow_new = [r for r in nb["per_notebook"] if r.get("ratio_new_kernel", 0) > 1.3]
        lines += ["", f"Papermill as the runner runs it against the same cells as a plain script (goal: at most 1.3×), "
                  f"over {len(nb['per_notebook'])} notebooks: "
                  + ("every one is within it" if not slow else "above it: " + ", ".join(
                      f"{r['entry']} ({r['ratio']})" for r in slow))
                  + "; with a new kernel process: " + ("every one is within it." if not slow_new else "above it: " + ", ".join(
                      f"{r['entry']} ({r['ratio_new_kernel']})" for r in slow_new) + "."), ""]
        m = nb["matrix"] or {}
        runs = f" ({m['runs']} runs)" if "runs" in m else ""
        lines += [] if not m else [f"The runner over these {len(nb['per_notebook'])} notebooks' matrix{runs}, each on its releases and "
                  f"environments: {m['jobs_1_s']} s serial, {m['jobs_2_s']} s with `--jobs 2`"
                  + (f", {m['jobs_2_new_kernels_s']} s with `--jobs 2` and a new kernel process per run."
                     if "jobs_2_new_kernels_s" in m else "."), ""]
    if results.get("breakdown"):
        from .breakdown import page_section

        lines += page_section(results["breakdown"])
    if results.get("launch"):
        la = results["launch"]
        spawn_total = sum(r["spawn_s"] for r in la["notebooks"])
        fork_total = sum(r["forkserver_s"] for r in la["notebooks"])
        lines += ["## Starting ranks", "",
                  "A notebook's multi-rank checks start fresh processes (`fixes.harness.launch`). Where every rank "
                  "runs on CPU they fork from one server process that imported torch and DeepSpeed once; where CUDA is "
                  "in play they are spawned, each importing both again. Both columns were measured on "
                  f"{la.get('machine', {}).get('date', '(date not recorded)')} on DeepSpeed {la['release']}, `spawn` forced with `FIXBOOK_START_METHOD=spawn`; load average "
                  f"{la.get('machine', {}).get('load_average', '(not recorded)')} when it started.", "",
                  f"One two-rank launch of a small ZeRO-2 job, median of {la['launches']}: spawned {la['spawn_s']} s, "
                  f"forked {la['forkserver_s']} s (the first forked launch, which starts the server: "
                  f"{la['forkserver_first_s']} s).", "",
                  "| Notebook (one run, cpu) | spawned s | forked s |", "|---|---|---|"]
        lines += [f"| {r['entry']} | {r['spawn_s']} | {r['forkserver_s']} |" for r in la["notebooks"]]
        lines += [f"| all {len(la['notebooks'])} | {round(spawn_total, 1)} | {round(fork_total, 1)} |", ""]
    if results.get("cli"):
        c = results["cli"]
        lines += ["## The command line", "",
                  f"On DeepSpeed {c['release']}: `import deepspeed` {c['import_deepspeed_s']} s, `fixbook doctor` "
                  f"{c['doctor_s']} s (ratio {c['doctor_ratio']}); `fixbook search` {c['search_ms_per_query']} ms per "
                  f"query over {c['queries']} labelled queries."
                  + (f" Median {c['search_median_ms']} ms per query over {c['search_timed']} (those and the users' "
                     "reports below)." if "search_median_ms" in c else ""), ""]
        if c.get("reports"):
            lines += ["How often the right entry comes first for real users' words (`python -m ci.bench.search_eval`: error "
                      "lines and prose copied from upstream and downstream threads; the held-out threads were never "
                      "tuned on), and how often an unrelated report that shares words with an entry gets a strong "
                      "answer:", "", "| Part | Top-1 right | Strong on unrelated reports |", "|---|---|---|"]
            lines += [f"| {name} | {f['right']} of {f['reports']} ({f['right'] / f['reports']:.0%}) | "
                      f"{f['strong_negatives']} of {f['negatives']} |" for name, f in c["reports"].items()]
            lines.append("")
    if results.get("check"):
        ch = results["check"]
        lines += ["## Checking a job", "",
                  f"`fixes.check(engine)` after `deepspeed.initialize` (a small ZeRO-2 engine, DeepSpeed {ch['release']}, "
                  f"measured on {ch['machine']['date']}, load average {ch['machine']['load_average']}): the first call "
                  f"{ch['first_ms']} ms (it loads the triggers and the measured matrix), then {ch['median_ms']} ms "
                  f"(median of {ch['calls']}).", ""]
    if results.get("site"):
        st = results["site"]
        largest = ", ".join(f"{entry} {size}" for entry, size in st["largest"])
        lines += ["## The site", "",
                  f"Measured on {st['machine']['date']}; load average {st['machine']['load_average']} when it started. "
                  f"`python -m ci.site` (the generated pages, from the notebook runs) {st['generate_s']} s; "
                  f"`mkdocs build --strict` {st['mkdocs_build_s']} s (median of {st['rounds']}). The search index is "
                  f"{st['index_bytes']} bytes; an entry page adds {st['index_bytes_per_entry']} bytes to it on average "
                  f"over {st['entries']} entries (largest: {largest}).", ""]
    if results.get("differential"):
        from .differential import page_lines

        lines += page_lines(results["differential"])
        if results.get("differential_parts"):
            from .differential import parts_lines

            lines += parts_lines(results["differential_parts"])
    if results.get("clean"):
        lines += clean_machine.page_lines(results["clean"])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--section", action="append", choices=["overhead", "notebooks", "breakdown", "launch", "cli", "site",
                                                               "check", "differential", "differential-parts", "clean"])
    parser.add_argument("--clean-mode", action="append", choices=list(clean_machine.MODES),
                        help="clean: which README command to time on a fresh clone (repeatable; default: both)")
    parser.add_argument("--keep", action="store_true",
                        help="clean: keep the fresh clone (its build/ holds each notebook run's seconds) and say where")
    parser.add_argument("--entry", action="append", help="only these entries (repeatable)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-matrix", action="store_true",
                        help="notebooks: per-notebook figures only, not the runner over their matrix")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per overhead run (after 3 warm-up)")
    parser.add_argument("--page", action="store_true", help=f"write {PAGE.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.page:
        PAGE.write_text(page(json.loads(RESULTS.read_text())))
        print(f"wrote {PAGE.relative_to(ROOT)}")
        return 0
    sections = args.section or ["overhead", "notebooks", "breakdown", "launch", "cli", "site", "check", "differential"]
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if not args.section and not args.entry:  # a whole run; a partial one keeps the record's and dates its own section
        results.update({"machine": machine(), "rounds": args.rounds})
    if "overhead" in sections:
        rows = overhead(args.rounds, args.entry, args.steps)
        if args.entry:  # a re-measurement of some entries replaces their rows, keeps the others'
            kept = {row["entry"]: row for row in results.get("overhead", [])}
            kept.update({row["entry"]: row for row in rows})
            rows = [kept[entry] for entry in bench_entries() if entry in kept]
        results["overhead"] = rows
    if "notebooks" in sections:
        results["notebooks"] = notebooks(args.rounds, args.entry, matrix_runs=not args.no_matrix)
    if "breakdown" in sections:
        from .breakdown import breakdown

        results["breakdown"] = breakdown(args.rounds, args.entry)
    if "launch" in sections:
        results["launch"] = launch(args.rounds, args.entry)
    if "cli" in sections:
        results["cli"] = cli(args.rounds)
    if "site" in sections:
        results["site"] = site(args.rounds)
    if "check" in sections:
        results["check"] = check(args.rounds)
    if "differential" in sections:  # read from the differential sweep's record: nothing is run
        from .differential import cost

        results["differential"] = cost()
        print("differential", results["differential"])
    if "differential-parts" in sections:  # never part of a whole run: it runs the whole grid
        from .differential import measure_parts

        results["differential_parts"] = measure_parts()
        print(f"differential parts: matrix wall time {results['differential_parts']['matrix_wall_s']} s")
    if "clean" in sections:  # never part of a whole run: it installs everything again from nothing
        clean = results.setdefault("clean", {})
        for mode in args.clean_mode or clean_machine.MODES:
            clean_machine.add_record(clean, mode, clean_machine.measure(mode, keep=args.keep))
            print(f"clean  {mode}: {clean[mode]['seconds']} s, exit {clean[mode]['exit']}, "
                  f"load {clean[mode]['load_start']} at the start, {clean[mode]['load_mean']} mean")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1))
    print(f"figures in {RESULTS.relative_to(ROOT)}")
    return 0

