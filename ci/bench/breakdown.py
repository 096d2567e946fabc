"""Where a notebook's time goes: ``python -m ci.bench --section breakdown``.

Per notebook on its reproduce release, the same code cells as one plain script (``ci.bench.scripts.notebook_script``), run
with a prelude that times, in the script's own process:

* ``imports_s`` — ``import torch, deepspeed, fixes.harness`` (the script's first cell would pay it);
* ``engine_build_s`` — every ``deepspeed.initialize`` call (``engine_builds`` of them);
* ``launch_s`` — every ``fixes.harness.launch`` call (``launches``): its ranks' start, their engine builds and
  their work, seen from the notebook;
* ``rest_s`` — the rest of the script's wall time, less the interpreter's start (``python_start_s``): the work in
  the notebook's own process (plain-PyTorch references, comparisons, checkpoints, ...).

And per release, ``kernel_start_s``: papermill over a one-cell notebook (``pass``) with the kernel forked from a warm
kernel server, as the runner runs it, against ``kernel_start_new_process_s``, a new Python per kernel — what a
notebook pays around its cells. Medians of the rounds.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import releases as release_env

RESULT_VARIABLE = "FIXBOOK_BENCH_BREAKDOWN"  # where the prelude writes its figures, at exit

# Runs before the notebook's cells, in the same namespace-free way (names prefixed, deleted after). Patches the
# names the cells and the entries reach: ``deepspeed.initialize``, ``fixes.harness.launch`` (the package's function)
# and ``fixes.harness.launch.launch`` (its module's), before any entry module imports them.
PRELUDE = '''
import atexit as _fb_atexit, json as _fb_json, os as _fb_os, sys as _fb_sys, time as _fb_time
_fb_started = _fb_time.perf_counter()
import torch as _fb_torch, deepspeed as _fb_deepspeed, fixes.harness as _fb_harness
_fb_figures = {"imports_s": _fb_time.perf_counter() - _fb_started, "engine_build_s": 0.0, "engine_builds": 0,
               "launch_s": 0.0, "launches": 0}

def _fb_timed(function, seconds, count):
    def timed(*args, **kwargs):
        started = _fb_time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            _fb_figures[seconds] += _fb_time.perf_counter() - started
            _fb_figures[count] += 1
    return timed

_fb_deepspeed.initialize = _fb_timed(_fb_deepspeed.initialize, "engine_build_s", "engine_builds")
_fb_launch = _fb_timed(_fb_harness.launch, "launch_s", "launches")
_fb_harness.launch = _fb_launch
_fb_sys.modules["fixes.harness.launch"].launch = _fb_launch

def _fb_write():
    _fb_figures["script_s"] = _fb_time.perf_counter() - _fb_started
    with open(_fb_os.environ["%s"], "w") as out:
        _fb_json.dump(_fb_figures, out)

_fb_atexit.register(_fb_write)
del _fb_torch, _fb_timed
''' % RESULT_VARIABLE


def time_script(code: str, release: str, scratch: Path, name: str = "script") -> dict[str, float]:
    """Run ``code`` after :data:`PRELUDE` on ``release`` (as ``ci.bench.scripts.script_command`` runs a notebook's cells):
    the prelude's figures, and ``wall_s``, the whole process's wall time. RuntimeError if it fails."""
    from .scripts import script_command

    script = scratch / f"{name}.py"
    script.write_text(PRELUDE + "\n" + code)
    out = scratch / f"{name}.json"
    out.unlink(missing_ok=True)
    started = time.perf_counter()
    done = release_env.run_python(release, script_command(script), timeout=900, capture_output=True, text=True,
                                  extra_env={"DS_ACCELERATOR": "cpu", RESULT_VARIABLE: str(out)})
    wall = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{name} as a script on {release} failed:\n{done.stderr[-2000:]}")
    return {**json.loads(out.read_text()), "wall_s": wall}


def _script_figures(entry: str, release: str, scratch: Path) -> dict[str, float]:
    """One run of the entry's cells as a script, timed (:func:`time_script`)."""
    from ..notebooks import runner
    from .scripts import notebook_script

    return time_script(notebook_script(runner.notebook_path(entry), {"results_file": ""}), release, scratch, entry)


def _python_start_s(release: str) -> float:
    started = time.perf_counter()
    release_env.run_python(release, ["-c", "pass"], timeout=120, capture_output=True, text=True)
    return time.perf_counter() - started


def _kernel_start_s(release: str, scratch: Path, rounds: int) -> tuple[float, float]:
    """Papermill over a one-cell notebook: (forked from a warm server, a new Python per kernel), medians."""
    from ..processes import kernels
    from ..notebooks import runner
    from .scripts import tiny_notebook

    kernel = release_env.kernel_name(release)
    notebook = tiny_notebook(scratch / "tiny.ipynb", kernel)

    def once() -> float:
        started = time.perf_counter()
        result = runner.execute(notebook, scratch / "tiny-out.ipynb", kernel, {}, 600)
        if not result.passed:
            raise RuntimeError(f"a one-cell notebook failed on {release}: {result.error}")
        return time.perf_counter() - started

    with kernels.servers() as servers:
        if servers is None:
            raise RuntimeError(f"no kernel server: {kernels.enabled()[1]}")
        once()  # starts the server
        forked = [once() for _ in range(rounds)]
        directory = os.environ.pop(kernels.DIR_VARIABLE)  # a new Python per kernel
        try:
            fresh = [once() for _ in range(rounds)]
        finally:
            os.environ[kernels.DIR_VARIABLE] = directory
    return statistics.median(forked), statistics.median(fresh)


def breakdown(rounds: int, entries: list[str] | None) -> dict[str, Any]:
    """The figures of this module's docstring for ``entries`` (default: every entry), and the machine."""
    import fixes

    from .scripts import machine

    when = machine()
    chosen = entries or fixes.available()
    rows, kernel_rows = [], {}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        for entry in chosen:
            release = fixes.get(entry).info.reproduce_release
            if release not in kernel_rows:
                forked, fresh = _kernel_start_s(release, scratch, rounds)
                kernel_rows[release] = {"release": release, "kernel_start_s": round(forked, 2),
                                        "kernel_start_new_process_s": round(fresh, 2)}
                print(f"kernel    DeepSpeed {release}: papermill over one cell {forked:.2f} s forked, "
                      f"{fresh:.2f} s with a new kernel process", flush=True)
            runs = [_script_figures(entry, release, scratch) for _ in range(rounds)]
            start = statistics.median(_python_start_s(release) for _ in range(rounds))
            median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            row = {"entry": entry, "release": release, "wall_s": round(median["wall_s"], 2),
                   "python_start_s": round(start, 2), "imports_s": round(median["imports_s"], 2),
                   "engine_build_s": round(median["engine_build_s"], 2), "engine_builds": int(median["engine_builds"]),
                   "launch_s": round(median["launch_s"], 2), "launches": int(median["launches"])}
            row["rest_s"] = round(max(0.0, median["wall_s"] - start - median["imports_s"] - median["engine_build_s"]
                                      - median["launch_s"]), 2)
            rows.append(row)
            print(f"breakdown {entry:<40} {row['wall_s']:6.2f} s: python {row['python_start_s']:.2f}, imports "
                  f"{row['imports_s']:.2f}, {row['engine_builds']} engine builds {row['engine_build_s']:.2f}, "
                  f"{row['launches']} launches {row['launch_s']:.2f}, the rest {row['rest_s']:.2f}", flush=True)
    return {"per_notebook": rows, "kernels": list(kernel_rows.values()), "rounds": rounds, "machine": when}


def page_section(results: dict[str, Any]) -> list[str]:
    """The Performance page's lines for a ``breakdown`` record."""
    where = results.get("machine", {})
    lines = ["## Where a notebook's time goes", "",
             "Each notebook's cells as one plain script on its reproduce release, timed inside the script "
             "(`ci/bench/breakdown.py`): the imports of its first cell (torch, DeepSpeed, the harness), every "
             "`deepspeed.initialize` in the notebook's own process (engine build), every `fixes.harness.launch` "
             "(ranks: their start, their engine builds and their work), and the rest of the work in the notebook's "
             f"process. Medians of {results['rounds']} round(s), measured on {where.get('date', '(date not recorded)')}; "
             f"load average {where.get('load_average', '(not recorded)')} when it started.", "",
             "| Notebook | Release | script s | python start s | imports s | engine builds | engine build s | "
             "launches | launch s | the rest s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['entry']} | {r['release']} | {r['wall_s']} | {r['python_start_s']} | {r['imports_s']} | "
              f"{r['engine_builds']} | {r['engine_build_s']} | {r['launches']} | {r['launch_s']} | {r['rest_s']} |"
              for r in results["per_notebook"]]
    rows = results["per_notebook"]
    total = sum(r["wall_s"] for r in rows) or 1.0
    parts = [("python start", "python_start_s"), ("imports", "imports_s"), ("engine builds", "engine_build_s"),
             ("rank launches", "launch_s"), ("the rest", "rest_s")]
    shares = ", ".join(f"{name} {sum(r[key] for r in rows):.1f} s ({100 * sum(r[key] for r in rows) / total:.0f}%)"
                       for name, key in parts)
    lines += ["", f"Over these {len(rows)} scripts, {total:.1f} s: {shares}.", "",
              "Around the cells, papermill and the kernel (a one-cell notebook, `pass`):", "",
              "| Release | forked kernel s | new kernel process s |", "|---|---|---|"]
    lines += [f"| {k['release']} | {k['kernel_start_s']} | {k['kernel_start_new_process_s']} |"
              for k in results["kernels"]]
    lines.append("")
    return lines
