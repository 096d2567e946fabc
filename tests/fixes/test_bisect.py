"""fixbook bisect: the algorithm on a synthetic answer, and a user's plain DeepSpeed script on real releases."""
import subprocess
import sys
from pathlib import Path

import fixes
from fixes import bisect, measured
from fixes.bisect import Run
from fixes.versions import SWEEP_SINCE

ROOT = Path(__file__).resolve().parents[2]
RELEASES = measured.load().releases  # the releases the sweep measured


def _probe(affected: set[str], crashing: set[str] = frozenset(), calls: list | None = None):
    def probe(release: str) -> Run:
        if calls is not None:
            calls.append(release)
        if release in crashing:
            return Run(release, "could not run", 1.0, "signal 11: Segmentation fault")
        return Run(release, "present" if release in affected else "absent", 1.0)
    return probe


def test_when_the_bug_spans_a_middle_range_then_bisection_finds_both_boundaries_with_few_runs():
    affected = set(RELEASES[12:19])
    calls: list[str] = []
    result = bisect.bisect(RELEASES, _probe(affected, calls=calls))
    assert result.ranges == [(RELEASES[12], RELEASES[18])] and result.first_fixed == RELEASES[19]
    assert len(calls) == len(set(calls)) < len(RELEASES) // 2, f"{len(calls)} runs for {len(RELEASES)} releases"
    assert {RELEASES[11], RELEASES[12], RELEASES[18], RELEASES[19]} <= set(calls)  # boundaries ran, both sides


def test_when_the_bug_spans_fewer_releases_than_the_sampling_step_then_it_is_still_found():
    # 19 releases sample every 4th: 3 affected releases between two samples agree with every sample.
    releases = RELEASES[:19]
    affected = set(releases[5:8])
    calls: list[str] = []
    result = bisect.bisect(releases, _probe(affected, calls=calls))
    assert result.ranges == [(releases[5], releases[7])] and result.first_fixed == releases[8]
    assert len(calls) < len(releases), f"{len(calls)} runs for {len(releases)} releases"  # denser samples, not all


def test_when_no_release_differs_then_every_release_ran_before_the_verdict():
    calls: list[str] = []
    result = bisect.bisect(RELEASES[:19], _probe(set(), calls=calls))
    assert sorted(calls) == sorted(RELEASES[:19]) and result.ranges == []


def test_when_the_script_crashes_on_some_releases_then_they_are_could_not_run_and_the_boundaries_hold():
    affected = set(RELEASES[12:19])
    crashing = {RELEASES[0], RELEASES[12], RELEASES[15]}
    result = bisect.bisect(RELEASES, _probe(affected, crashing))
    assert result.runs[RELEASES[12]].outcome == "could not run"
    assert result.first_fixed == RELEASES[19] and result.last_affected == RELEASES[18]
    assert result.first_affected in (RELEASES[13], RELEASES[12])  # the crash hides whether 12 has it
    assert "could not run on" in result.summary and RELEASES[12] in result.summary
    assert result.verdict(RELEASES[15]) == "present"  # it crashed, but runs on either side agree


def test_when_interrupted_then_the_runs_done_are_kept():
    calls: list[str] = []

    def probe(release: str) -> Run:
        if len(calls) == 4:
            raise KeyboardInterrupt
        calls.append(release)
        return Run(release, "absent", 1.0)

    result = bisect.bisect(RELEASES, probe)
    assert result.interrupted and len(result.runs) == 4 and "interrupted" in result.summary


def test_when_a_users_script_is_bisected_on_real_releases_then_it_finds_the_sweep_s_boundaries_and_names_the_entry(tmp_path):
    """The script is plain DeepSpeed (tests/fixes/data/bisect_zero2_grad_accum.py), not the entry's
    reproduce(); the releases are those installed in .deepspeed (--offline)."""
    cache = ROOT / ".deepspeed"
    releases = bisect.final_releases(SWEEP_SINCE, cache, offline=True)  # the CLI's default --since
    sweep = fixes.get("zero2-grad-accum-last-microbatch").info.sweep
    assert sweep.first_affected in releases and sweep.first_fixed in releases, "the entry's boundaries are installed"
    out = tmp_path / "bisect.json"
    done = subprocess.run([sys.executable, "-m", "fixes.cli", "bisect", str(ROOT / "tests/fixes/data/bisect_zero2_grad_accum.py"),
                           "--offline", "--cache", str(cache), "--json", str(out), "--timeout", "300"],
                          capture_output=True, text=True, timeout=3000, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    expected = [r for r in releases if sweep.expected_affected(r)]
    assert (result["first_affected"], result["last_affected"]) == (expected[0], expected[-1])
    later = releases[releases.index(expected[-1]) + 1:]
    assert result["first_fixed"] == next(r for r in later if sweep.expected_affected(r) is False)
    assert len(result["runs"]) < len(releases), result["summary"]
    assert "looks like zero2-grad-accum-last-microbatch" in done.stdout
    print(f"\n{result['summary']}\n{done.stdout}")
