"""ci/bench/breakdown.py: the prelude that times a notebook's cells, and its page section."""
from ci.bench import breakdown as bench_breakdown
from ci import releases

MACHINE = {"date": "2026-11-25", "cpus": 2, "processor": "x86_64", "python": "3.11.7", "load_average": 0.4}


def test_when_a_script_builds_engines_and_launches_ranks_then_the_prelude_counts_and_times_them(tmp_path):
    code = """
import os
from fixes import harness
from fixes.harness.launch import launch as launch_by_module  # an entry's own import of it
harness.setup()
for _ in range(2):
    harness.build_engine(harness.Job())
assert harness.launch(os.getpid, 2) and launch_by_module(os.getpid, 2)
"""
    figures = bench_breakdown.time_script(code, releases.load().newest, tmp_path)
    assert figures["engine_builds"] == 2 and figures["engine_build_s"] > 0
    assert figures["launches"] == 2 and figures["launch_s"] > 0, "both names of launch are timed"
    assert figures["imports_s"] > 0
    assert figures["imports_s"] + figures["engine_build_s"] + figures["launch_s"] <= figures["script_s"] \
        <= figures["wall_s"]


def test_when_a_script_fails_then_the_error_names_it_and_shows_its_stderr(tmp_path):
    import pytest

    with pytest.raises(RuntimeError, match=r"(?s)broken as a script on .* failed.*ZeroDivisionError"):
        bench_breakdown.time_script("1 / 0", releases.load().newest, tmp_path, "broken")


def test_when_a_breakdown_is_recorded_then_the_page_shows_each_part_and_the_shares():
    row = {"entry": "a", "release": "0.18.2", "wall_s": 10.0, "python_start_s": 0.5, "imports_s": 2.5,
           "engine_build_s": 1.0, "engine_builds": 4, "launch_s": 5.0, "launches": 3, "rest_s": 1.0}
    record = {"per_notebook": [row], "rounds": 3, "machine": MACHINE,
              "kernels": [{"release": "0.18.2", "kernel_start_s": 0.45, "kernel_start_new_process_s": 0.5}]}
    text = "\n".join(bench_breakdown.page_section(record))
    assert "Medians of 3 round(s), measured on 2026-11-25; load average 0.4" in text
    assert "| a | 0.18.2 | 10.0 | 0.5 | 2.5 | 4 | 1.0 | 3 | 5.0 | 1.0 |" in text
    assert ("Over these 1 scripts, 10.0 s: python start 0.5 s (5%), imports 2.5 s (25%), engine builds 1.0 s (10%), "
            "rank launches 5.0 s (50%), the rest 1.0 s (10%).") in text
    assert "| 0.18.2 | 0.45 | 0.5 |" in text
