"""The release sweep: how answers are classified, how a crashing entry is isolated, how ranges
are derived, that the committed file covers every entry × release, and — re-run here — that every
entry's boundary releases still give the recorded answer."""
from collections import defaultdict

import pytest

import fixes
from ci import releases, site, sweep
from fixes import measured


def observation(release, status, **fields):
    return measured.Observation(release, status, **fields)


def entry_sweep(statuses: dict[str, str]) -> measured.EntrySweep:
    return measured.EntrySweep("x", {r: observation(r, s) for r, s in statuses.items()})


@pytest.mark.parametrize(("probe", "reproduced", "status"), [
    (True, True, "affected"), (False, False, "not affected"), (True, None, "affected"),
    (None, False, "not affected"), (True, False, "inconsistent"), (False, True, "inconsistent"),
    (None, None, "could not run")])
def test_when_probe_and_reproduce_answer_then_status_follows(probe, reproduced, status):
    assert measured.classify(probe, reproduced)[0] == status


def test_when_releases_change_answer_then_range_and_first_fixed_are_derived():
    found = entry_sweep({"0.16.0": "could not run", "0.17.5": "not affected", "0.17.6": "affected",
                         "0.18.2": "affected", "0.18.3": "not affected", "0.19.8": "not affected"})
    assert (found.first_affected, found.last_affected, found.first_fixed) == ("0.17.6", "0.18.2", "0.18.3")
    assert found.range_text == "0.17.6 – 0.18.2"
    assert found.boundaries == ["0.17.6", "0.18.2", "0.18.3"]
    assert found.expected_affected("0.16.0") is None and found.expected_affected("0.18.2") is True


def test_when_newest_release_is_affected_then_nothing_is_fixed():
    found = entry_sweep({"0.18.2": "not affected", "0.18.3": "affected", "0.19.8": "affected"})
    assert found.first_fixed is None
    assert found.range_text == "0.18.3 – 0.19.8 (newest swept)"


def test_when_an_unrun_release_interrupts_then_ranges_claim_nothing_for_it():
    found = entry_sweep({"0.17.0": "affected", "0.17.1": "could not run", "0.17.2": "affected",
                         "0.17.3": "inconsistent", "0.17.4": "not affected"})
    assert found.ranges == [("0.17.0", "0.17.0"), ("0.17.2", "0.17.2")]
    assert found.first_fixed == "0.17.4"


def test_when_sweep_data_is_written_then_it_reads_back_equal(tmp_path):
    data = measured.SweepData(releases=["0.18.2", "0.19.8"], torch="2.13.0", python="3.11", last_run={"wall_s": 1.0},
                              results={"x": entry_sweep({"0.18.2": "affected", "0.19.8": "not affected"})})
    measured.write(data, tmp_path / "sweep.json")
    assert measured.read(tmp_path / "sweep.json") == data


def test_when_a_partial_sweep_is_merged_then_only_its_rows_change():
    old = measured.SweepData(releases=["0.18.2"], results={
        "x": entry_sweep({"0.18.2": "affected"}), "y": entry_sweep({"0.18.2": "not affected"})})
    new = {sweep.Pair("x", "0.18.2"): observation("0.18.2", "not affected"),
           sweep.Pair("x", "0.19.8"): observation("0.19.8", "not affected")}
    merged = sweep.merge(old, new, ["0.18.2", "0.19.8"], {})
    assert merged.releases == ["0.18.2", "0.19.8"]
    assert merged.entry("x").unaffected == ["0.18.2", "0.19.8"]
    assert merged.entry("y").get("0.18.2").status == "not affected"


def test_when_the_shared_child_crashes_then_only_the_crashing_entry_is_recorded_as_such(monkeypatch):
    done = {"probe": True, "reproduced": True, "done": True, "evidence": "e", "seconds": 1.0}
    calls = []

    def fake_run_child(release, entries, timeout):
        calls.append(entries)
        if len(entries) > 1:  # the shared child: "a" answered, "b" segfaulted, "c" never ran
            return {"a": {"entry": "a", **done}, "b": {"entry": "b", "probe": True, "done": False}}, \
                "killed by signal 11; last error: Fatal Python error: Segmentation fault"
        if entries == ["b"]:
            return {"b": {"entry": "b", "probe": True, "done": False}}, "killed by signal 11"
        return {entries[0]: {"entry": entries[0], **done, "reproduced": False, "probe": False}}, ""

    monkeypatch.setattr(sweep, "run_child", fake_run_child)
    found = sweep.run_release("0.19.8", ["a", "b", "c"], timeout=10)
    assert calls == [["a", "b", "c"], ["b"], ["c"]]
    assert found["a"].status == "affected"
    assert found["b"].status == "could not run" and "signal 11" in found["b"].reason and found["b"].probe is True
    assert found["c"].status == "not affected"


def test_when_a_child_times_out_then_the_entry_could_not_run_with_the_reason(monkeypatch):
    monkeypatch.setattr(sweep, "run_child", lambda release, entries, timeout: ({}, f"timed out after {timeout:.0f} s"))
    [found] = sweep.run_release("0.18.2", ["a"], timeout=7).values()
    assert found.status == "could not run" and found.reason == "timed out after 7 s"


# The committed file.

DATA = measured.load()


def test_when_sweep_file_is_committed_then_it_covers_every_entry_and_release():
    assert set(releases.load().releases) <= set(DATA.releases)
    assert DATA.releases[0] == sweep.SINCE and DATA.releases[-1] == releases.load().newest
    missing = [(entry, release) for entry in fixes.available() for release in DATA.releases
               if DATA.entry(entry).get(release) is None]
    assert not missing, f"not swept: {missing[:10]}"
    unexplained = [(entry, release) for entry, found in DATA.results.items() for release in found.releases
                   if found.get(release).status == "could not run" and not found.get(release).reason]
    assert not unexplained


def _boundary_releases() -> dict[str, list[str]]:
    by_release: dict[str, list[str]] = defaultdict(list)
    for entry in fixes.available():
        for release in DATA.entry(entry).boundaries:
            by_release[release].append(entry)
    return dict(sorted(by_release.items()))


BOUNDARIES = _boundary_releases()


@pytest.mark.parametrize("release", list(BOUNDARIES))
def test_when_boundary_release_is_swept_again_then_each_entry_gives_the_recorded_answer(release):
    if not releases.is_installed(release):
        pytest.fail(f"DeepSpeed {release} is not installed: run `bash ci/setup.sh`")
    again = sweep.run_release(release, BOUNDARIES[release], timeout=300)
    changed = {entry: (DATA.entry(entry).get(release).status, found.status, found.reason)
               for entry, found in again.items() if found.status != DATA.entry(entry).get(release).status}
    assert not changed, f"DeepSpeed {release}: recorded vs now (status, reason): {changed}"
    fix_changed = {entry: (DATA.entry(entry).get(release).fix, found.fix, found.fix_reason)
                   for entry, found in again.items() if found.fix != DATA.entry(entry).get(release).fix}
    assert not fix_changed, f"DeepSpeed {release}: fix coverage recorded vs now (fix, reason): {fix_changed}"


def test_when_sweep_file_is_committed_then_every_affected_row_says_what_the_fix_does():
    unmeasured = [(entry, release) for entry, found in DATA.results.items() for release in found.affected
                  if found.get(release).fix not in measured.FIX_STATUSES]
    assert not unmeasured, f"affected rows without fix coverage: {unmeasured[:10]}"
    unexplained = [(entry, release) for entry, found in DATA.results.items() for release in found.unfixable
                   if not found.get(release).fix_reason]
    assert not unexplained
    fixed, affected = site.coverage_summary()
    assert 0 < fixed <= affected


class _CoverageFix:
    """What sweep.coverage() needs of a fix: an id and a behavioural check."""

    def __init__(self, still_buggy: bool):
        self.id, self.still_buggy = "fake", still_buggy

    def reproduce(self):
        return self.still_buggy


@pytest.mark.parametrize(("apply_result", "still_buggy", "expected"), [
    ("applied", False, "fixed"), ("applied", True, "not fixed"), ("drift", False, "refused"),
    ("boom", False, "could not run"), ("not needed", False, "not fixed")])
def test_when_coverage_is_measured_then_the_fix_status_follows(monkeypatch, apply_result, still_buggy, expected):
    reverted = []

    def apply(fix_id):
        if apply_result == "drift":
            raise fixes.DriftError("new code")
        if apply_result == "boom":
            raise RuntimeError("boom")
        return [fixes.Outcome(fix_id, apply_result, "msg")]

    monkeypatch.setattr(fixes, "apply", apply)
    monkeypatch.setattr(fixes, "revert", lambda fix_id: reverted.append(fix_id))
    answer = sweep.coverage(_CoverageFix(still_buggy))
    assert answer["fix"] == expected and answer["fix_reason"]
    assert reverted == ([] if apply_result in ("drift", "boom") else ["fake"])


def test_when_readme_quotes_the_sweep_then_it_is_what_the_file_says():
    readme = (releases.ROOT / "README.md").read_text()
    assert sweep.summary(DATA) in readme, "README's sweep block is stale: paste `python -m ci.sweep --summary`"
