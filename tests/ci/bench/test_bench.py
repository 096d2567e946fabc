"""The benchmark's page: what ``python -m ci.bench --page`` writes from a results file (no timing here:
the benchmark prints figures, tests check behaviour)."""
import json

import pytest

from ci import bench

MACHINE = {"date": "2026-11-24", "cpus": 2, "processor": "x86_64", "python": "3.11.7", "load_average": 0.9}


def results(**rows):
    return {"machine": MACHINE, "rounds": 5, **rows}


def overhead_row(entry, ratio, spread, **extra):
    return {"entry": entry, "release": "0.18.2", "fixed_ms": 70.0, "baseline": "0.18.3 (upstream fixed)",
            "baseline_ms": 70.0 / ratio, "ratio": ratio, "round_ratios": spread, **extra}


def test_when_a_fix_is_within_the_goal_then_its_row_shows_the_rounds_spread_and_no_goal_line():
    text = bench.page(results(overhead=[overhead_row("a-fix", 0.99, [0.95, 1.01])]))
    assert "| a-fix | 0.18.2 | 70.0 | 0.18.3 (upstream fixed) |" in text and "| 0.950-1.010 |" in text
    assert "Above the 1.02 goal" not in text


def test_when_the_release_is_held_equal_then_the_goal_is_judged_on_that_ratio():
    same = {"same_release_ms": 71.0, "same_release_ratio": 0.986, "same_release_round_ratios": [0.9, 1.1]}
    text = bench.page(results(overhead=[overhead_row("engine-tensor-backward", 1.05, [0.8, 1.3], **same)]))
    assert "**engine-tensor-backward, the release held equal.** The same job through `engine.backward(loss)`" in text
    assert "ratio 0.986 (per round 0.900-1.100)" in text
    assert "Above the 1.02 goal" not in text  # 1.05 is across releases; with the release equal it is 0.986
    text = bench.page(results(overhead=[overhead_row("c-fix", 1.05, [1.03, 1.08])]))
    assert "Above the 1.02 goal: c-fix (1.05)." in text
    text = bench.page(results(overhead=[overhead_row("d-fix", 1.043, [0.953, 1.301])]))
    assert "Above the 1.02 goal: d-fix (1.043; its rounds reach 0.953, within this machine's noise)." in text


def test_when_ratios_are_spread_then_the_lowest_and_highest_are_recorded_as_numbers_and_shown():
    assert bench._spread([1.0, 0.6871, 1.1874]) == [0.687, 1.187]
    assert bench._spread_text([0.95, 1.2]) == "0.950-1.200" and bench._spread_text(None) == ""


def test_when_papermill_costs_more_than_the_goal_then_the_page_names_the_notebook():
    def row(entry, ratio, ratio_new_kernel):
        return {"entry": entry, "release": "0.17.6", "papermill_s": 6.0, "script_s": round(6.0 / ratio, 1),
                "ratio": ratio, "papermill_new_kernel_s": 8.0, "ratio_new_kernel": ratio_new_kernel,
                "python_start_s": 0.05, "import_deepspeed_s": 5.2}

    matrix = {"runs": 4, "jobs_1_s": 300.0, "jobs_2_s": 200.0, "jobs_2_new_kernels_s": 250.0}
    text = bench.page(results(notebooks={"per_notebook": [row("a", 1.19, 1.2), row("b", 1.31, 1.5)], "matrix": matrix}))
    assert "over 2 notebooks: above it: b (1.31); with a new kernel process: above it: b (1.5)." in text
    assert "matrix (4 runs)" in text and \
        "300.0 s serial, 200.0 s with `--jobs 2`, 250.0 s with `--jobs 2` and a new kernel process per run." in text
    assert "| a | 0.17.6 | 6.0 | 8.0 | 5.0 | 1.19 | 1.2 | 0.05 | 5.2 |" in text
    text = bench.page(results(notebooks={"per_notebook": [row("a", 0.8, 1.4)], "matrix": matrix}))
    assert "over 1 notebooks: every one is within it; with a new kernel process: above it: a (1.4)." in text
    text = bench.page(results(notebooks={"per_notebook": [row("a", 0.8, 1.4)], "matrix": None}))  # --no-matrix
    assert "over 1 notebooks" in text and "matrix" not in text


def test_when_the_performance_page_is_committed_then_it_is_the_page_of_the_committed_record():
    import json

    assert bench.PAGE.read_text() == bench.page(json.loads(bench.RESULTS.read_text())), \
        "docs/performance.md differs from its record: python -m ci.bench --page"


def test_when_launch_times_are_recorded_then_the_page_compares_spawned_and_forked_ranks():
    launch = {"release": "0.19.8", "launches": 5, "spawn_first_s": 6.0, "spawn_s": 4.6, "forkserver_first_s": 4.2,
              "forkserver_s": 2.3, "machine": {**MACHINE, "load_average": 1.7},
              "notebooks": [{"entry": "a-notebook", "spawn_s": 42.5, "forkserver_s": 27.8},
                            {"entry": "b-notebook", "spawn_s": 20.0, "forkserver_s": 14.7}]}
    text = bench.page(results(launch=launch))
    assert "## Starting ranks" in text and "measured on 2026-11-24 on DeepSpeed 0.19.8" in text
    assert "median of 5: spawned 4.6 s, forked 2.3 s (the first forked launch, which starts the server: 4.2 s)" in text
    assert "| a-notebook | 42.5 | 27.8 |" in text and "| all 2 | 62.5 | 42.5 |" in text


def test_when_an_entry_defines_a_bench_job_then_the_committed_record_has_its_overhead_row():
    """An entry whose fix is on the training path (its reproduce.py defines ``bench_job``) has its price on the
    Performance page: ``python -m ci.bench --section overhead --entry ID``, then ``--page``."""
    import json

    from ci import ROOT

    defined = {path.parent.name.replace("_", "-") for path in (ROOT / "fixes" / "entries").glob("*/reproduce.py")
               if "\ndef bench_job(" in path.read_text()}
    recorded = {row["entry"] for row in json.loads(bench.RESULTS.read_text())["overhead"]}
    assert defined, "no entry defines bench_job: the scan is wrong"
    assert defined <= recorded, f"no overhead row for: {sorted(defined - recorded)}"


def test_when_the_search_index_is_read_then_each_entry_page_counts_all_its_sections_and_nothing_else():
    docs = [{"location": "generated/entries/a-fix/", "title": "A", "text": "x" * 10},
            {"location": "generated/entries/a-fix/#symptom", "title": "Symptom", "text": "y" * 20},
            {"location": "generated/entries/b-fix/", "title": "B", "text": ""},
            {"location": "generated/status/", "title": "Status", "text": "z" * 99},
            {"location": "", "title": "Home", "text": "w"}]
    sizes = bench.index_sizes({"docs": docs})
    assert sizes == {"a-fix": len(json.dumps(docs[0])) + len(json.dumps(docs[1])), "b-fix": len(json.dumps(docs[2]))}


def test_when_site_figures_are_recorded_then_the_page_shows_build_time_index_size_and_per_entry_size():
    site = {"generate_s": 1.5, "mkdocs_build_s": 6.25, "rounds": 3, "index_bytes": 347953, "entries": 28,
            "index_bytes_per_entry": 9876, "largest": [["a-fix", 20000], ["b-fix", 15000]], "machine": MACHINE}
    text = bench.page(results(site=site))
    assert "## The site" in text and "`mkdocs build --strict` 6.25 s (median of 3)" in text
    assert "347953 bytes" in text and "9876 bytes to it on average over 28 entries (largest: a-fix 20000, b-fix 15000)" in text


def test_when_no_notebook_runs_are_built_then_the_site_section_says_what_to_run(tmp_path):
    with pytest.raises(RuntimeError, match="bash ci/build.sh"):
        bench.site(1, build=tmp_path)
