"""The release sweep: how answers are classified, how a crashing entry is isolated, how ranges
are derived, that the committed file covers every entry × release, and — re-run here — that every
entry's boundary releases still give the recorded answer."""
import importlib.metadata
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


def test_when_the_oldest_release_measured_is_affected_then_the_range_says_since_at_least():
    found = entry_sweep({"0.14.4": "affected", "0.15.4": "affected", "0.16.0": "not affected",
                         "0.17.0": "affected", "0.19.8": "affected"})
    assert found.starts_at_oldest
    assert found.range_text == ("since at least 0.14.4 (the oldest release measured) to 0.15.4, "
                                "0.17.0 – 0.19.8 (newest swept)")
    alone = entry_sweep({"0.14.4": "affected", "0.14.5": "not affected"})
    assert alone.range_text == "since at least 0.14.4 (the oldest release measured), not after it"


def test_when_the_oldest_release_measured_is_not_affected_then_the_range_starts_where_the_bug_does():
    found = entry_sweep({"0.14.4": "not affected", "0.15.0": "affected", "0.19.8": "not affected"})
    assert not found.starts_at_oldest and found.range_text == "0.15.0"


def test_when_every_older_release_could_not_run_then_the_range_says_since_at_least_and_why():
    unrun = entry_sweep({"0.14.4": "could not run", "0.14.5": "could not run", "0.15.0": "affected",
                         "0.15.1": "affected", "0.15.2": "not affected"})
    assert not unrun.starts_at_oldest and unrun.start_unknown
    assert unrun.range_text == "since at least 0.15.0 (older releases measured could not run) to 0.15.1"
    mixed = entry_sweep({"0.14.4": "could not run", "0.14.5": "inconsistent", "0.15.0": "affected",
                         "0.15.1": "not affected"})
    assert mixed.range_text == "since at least 0.15.0 (no older release was measured not affected), not after it"


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
    # The probe on its own, too: where reproduce() decides the status, the probe must still say what it said (the
    # contract's probe checks leave these releases to this test, tests/fixes/test_contract.py)
    probe_changed = {entry: (DATA.entry(entry).get(release).probe, found.probe, found.reason)
                     for entry, found in again.items() if found.probe != DATA.entry(entry).get(release).probe}
    assert not probe_changed, f"DeepSpeed {release}: the probe recorded vs now (probe, reason): {probe_changed}"
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


# Durability (a sweep keeps what it measured through interrupts, crashes and a second sweep).

import json as _json
import os as _os
import signal as _signal
import subprocess as _subprocess
import sys as _sys
import time as _time

# Three releases, one at a time. The sweep holds after its first save until the test lets it go (FIXBOOK_SWEEP_HOLD),
# so the signal lands after exactly one saved release whatever the machine's load. (Racing a poll loop instead, a
# clean clone under a load average of 5 once saw all three saved before the signal.)
SMALL_RELEASES = ["0.17.6", "0.18.2", "0.18.4"]
SMALL = ["--entry", "zero12-flat-buffer-detach", *[arg for r in SMALL_RELEASES for arg in ("--release", r)], "--jobs", "1"]


def _start_sweep(out, *extra, hold=None):
    env = {**_os.environ, sweep.HOLD: str(hold)} if hold else None
    return _subprocess.Popen([_sys.executable, "-m", "ci.sweep", *SMALL, "--out", str(out), *extra],
                             cwd=releases.ROOT, stdout=_subprocess.PIPE, stderr=_subprocess.PIPE, text=True, env=env)


def _rows(out) -> dict:
    if not out.exists():
        return {}
    return _json.loads(out.read_text())["results"].get("zero12-flat-buffer-detach", {})


def _wait_for_first_release(proc, out, timeout=600, hold=None):
    deadline = _time.monotonic() + timeout
    while _time.monotonic() < deadline and proc.poll() is None:
        if (hold / "saved-1").exists() if hold else _rows(out):
            return
        _time.sleep(0.05)
    raise AssertionError(f"no release was saved within {timeout} s (exit {proc.poll()})")


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGKILL"])
def test_when_a_sweep_is_killed_then_finished_releases_are_in_the_file_and_resume_measures_the_rest(
        tmp_path, signal_name):
    out, hold = tmp_path / "sweep.json", tmp_path / "hold"
    hold.mkdir()
    proc = _start_sweep(out, hold=hold)
    _wait_for_first_release(proc, out, hold=hold)  # the sweep now waits, holding one saved release
    proc.send_signal(getattr(_signal, signal_name))
    _, stderr = proc.communicate(timeout=120)
    saved = _rows(out)  # the file parses
    assert len(saved) == 1 and not (hold / "saved-2").exists(), saved  # killed mid-sweep: what finished is kept
    if signal_name == "SIGINT":
        assert proc.returncode == 130 and "interrupted" in stderr
    resumed = _subprocess.run([_sys.executable, "-m", "ci.sweep", *SMALL, "--out", str(out), "--resume"],
                              cwd=releases.ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rest = len(SMALL_RELEASES) - len(saved)
    assert f"--resume: {rest} of {len(SMALL_RELEASES)} rows to measure" in resumed.stderr
    after = _rows(out)
    assert set(after) == set(SMALL_RELEASES)
    assert {release: after[release] for release in saved} == saved  # the saved rows were not measured again


def test_when_one_entry_module_changes_then_resume_plans_that_entry_only(monkeypatch):
    entries = ["zero12-flat-buffer-detach", "zero2-grad-accum-last-microbatch"]
    codes = {entry: measured.entry_code(entry) for entry in entries}
    rows = {entry: measured.EntrySweep(entry, {r: observation(r, "not affected", code=codes[entry])
                                               for r in ("0.18.2", "0.18.4")}) for entry in entries}
    old = measured.SweepData(releases=["0.18.2", "0.18.4"], results=rows)
    assert sweep.plan_for(entries, ["0.18.2", "0.18.4"], old) == {}
    monkeypatch.setattr(measured, "entry_code",
                        lambda entry: "edited" if entry == "zero2-grad-accum-last-microbatch" else codes[entry])
    assert sweep.plan_for(entries, ["0.18.2", "0.18.4"], old) == {
        "0.18.2": ["zero2-grad-accum-last-microbatch"], "0.18.4": ["zero2-grad-accum-last-microbatch"]}


def test_when_two_sweeps_share_a_file_then_the_second_refuses_and_no_row_is_lost(tmp_path):
    out = tmp_path / "sweep.json"
    first = sweep.Recorder(out)
    with first:
        with pytest.raises(sweep.SweepBusyError, match=f"pid {_os.getpid()}.*is writing {out}"):
            sweep.Recorder(out).__enter__()
        second = _subprocess.run([_sys.executable, "-m", "ci.sweep", *SMALL, "--out", str(out)],
                                 cwd=releases.ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and "another sweep" in second.stderr
        first.save({sweep.Pair("zero12-flat-buffer-detach", "0.18.2"): observation("0.18.2", "not affected")},
                   ["0.18.2"], {"at": "now"})
    assert set(_rows(out)) == {"0.18.2"}
    with sweep.Recorder(out):  # the lock is released with the first sweep
        pass


def test_when_the_sweep_file_is_truncated_then_show_doctor_and_the_site_name_it(tmp_path, monkeypatch, capsys):
    from fixes import cli

    damaged = tmp_path / "sweep.json"
    damaged.write_text(measured.DATA.read_text()[:500])
    monkeypatch.setattr(measured, "DATA", damaged)
    measured.load.cache_clear()
    try:
        assert cli.main(["show", "zero12-flat-buffer-detach"]) == 2
        assert f"the sweep file {damaged} is damaged" in capsys.readouterr().err
        monkeypatch.setattr(cli, "installed_deepspeed", lambda: "0.18.9")
        assert cli.main(["doctor"]) == 2
        assert f"the sweep file {damaged} is damaged" in capsys.readouterr().err
        with pytest.raises(fixes.FixbookError, match=f"the sweep file {damaged} is damaged"):
            site.matrix_page()
    finally:
        measured.load.cache_clear()


def test_when_a_sweep_saves_rows_then_torch_is_not_imported(tmp_path):
    """A save takes milliseconds: the durability tests above signal the sweep the moment a row appears."""
    code = ("import sys, ci.sweep as s, fixes.measured as m\n"
            f"with s.Recorder(m.Path({str(tmp_path / 'sweep.json')!r})) as r:\n"
            "    r.save({s.Pair('zero12-flat-buffer-detach', '0.18.2'): m.Observation('0.18.2', 'not affected')}, ['0.18.2'], {})\n"
            "print('torch' in sys.modules, m.read(r.path).torch)")
    done = _subprocess.run([_sys.executable, "-c", code], cwd=releases.ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    imported, version = done.stdout.split()
    assert imported == "False" and version == importlib.metadata.version("torch")


def test_when_a_reason_names_a_file_in_the_checkout_then_the_record_keeps_its_relative_path() -> None:
    path = releases.ROOT / ".deepspeed" / "0.14.4" / "deepspeed" / "runtime" / "zero" / "__init__.py"
    answer = {"done": False, "error": f"ImportError: cannot import name 'x' ({path})", "probe": None}
    observed = sweep.observe("0.14.4", answer, "")
    assert observed.status == "could not run"
    assert observed.reason == "ImportError: cannot import name 'x' (.deepspeed/0.14.4/deepspeed/runtime/zero/__init__.py)"
    assert str(releases.ROOT) not in sweep.observe("0.14.4", None, f"crashed in {path}").reason
