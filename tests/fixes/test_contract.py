"""The entry contract: every check every registered entry must pass, the definition of done, run on every entry
the registry discovers (``fixes/entries/<id>/``), so a new entry gets all of it without a line of its own test code.

* metadata complete: title, summary, symptom, components, error signatures, upstream issues or pull requests (or a
  note saying why there are none), a root cause naming DeepSpeed files that exist in the reproduce release, the
  targets its drift check covers, a notebook;
* the probe, and the behavioural check (``reproduce()``) where the sweep ran it, agree with the measured matrix
  (``fixes/data/sweep.json``): affected on the reproduce release, unaffected on the newest (an entry still affected on
  the newest release: the last release measured unaffected before it appeared, if one was swept);
* apply/revert exact and idempotent on the reproduce release; the entry's ``reproduce()`` (the sweep's
  behavioural check) finds the bug there, not with the fix applied, and again after revert;
* the sweep's boundary releases (first and last affected, first fixed) are re-checked once, by
  ``tests/ci/sweep/test_sweep.py``: status, probe and fix coverage (apply, ``reproduce()``, revert) against the row
  recorded there; the checks here leave them out instead of measuring them a second time;
* drift refused (DriftError naming the target) before anything is patched, for each target in turn;
* a no-op that says so on each unaffected release (an entry measured affected on every release swept: the sweep says
  so, and the fix applies and reverts exactly on the newest release instead);
* the trigger agrees with its measured grid (``fixes/data/triggers.json``);
* notebook selection: the entry's notebook runs on its reproduce release and the newest, and selecting the entry's
  notebook tests executes those runs and no other entry's.

The checks that need DeepSpeed run in a child process of the release (``tests/helpers.call_in_release``) from
``tests/fixes/contract_checks.py``. An entry's own ``tests/fixes/entries/<id>/`` holds only what is specific to it.
"""
from __future__ import annotations

import re
from functools import cache
from types import SimpleNamespace

import pytest

import fixes
from ci import releases
from ci.notebooks import runner
from fixes.versions import parse
from tests.fixes import contract_checks as checks
from tests.helpers import call_in_release

ENTRIES = fixes.available()


@cache
def full_matrix() -> list[tuple[str, str, str]]:
    """Every notebook run (``ci.notebooks.runner.matrix()``, seconds to read): once per test process."""
    return runner.matrix()


def known_releases() -> list[str]:
    """The releases the tests may run on: the release set and the sweep's boundary releases (``ci/setup.sh``
    installs both)."""
    return sorted({*releases.load().releases, *releases.sample_releases()}, key=parse)


def affected_releases(fix_id: str) -> list[str]:
    """Where the bug must be there: the reproduce release and the first and last releases measured affected."""
    info = fixes.get(fix_id).info
    return sorted({r for r in (info.reproduce_release, info.sweep.first_affected, info.sweep.last_affected) if r},
                  key=parse)


def rechecked_by_the_sweep(fix_id: str) -> set[str]:
    """The entry's sweep boundary releases, which ``tests/ci/sweep/test_sweep.py`` measures again (status, probe, and
    the fix's coverage); the reproduce release is always checked here as well (apply/revert, and reproduce() again
    after revert)."""
    info = fixes.get(fix_id).info
    return set(info.sweep.boundaries) - {info.reproduce_release}


def unaffected_releases(fix_id: str) -> list[str]:
    """Where the contract checks the bug is not there: the first release measured fixed and the newest, if measured
    unaffected; for an entry still affected on the newest release, the last known release measured unaffected
    before its first affected one (none where it was affected from the first release swept)."""
    info = fixes.get(fix_id).info
    newest = releases.load().newest
    found = {info.sweep.first_fixed} if info.sweep.first_fixed else set()
    if info.expected_affected(newest) is False:
        found.add(newest)
    if not found and info.sweep.first_affected:
        earlier = [r for r in known_releases() if parse(r) < parse(info.sweep.first_affected)
                   and info.expected_affected(r) is False]
        found.update(earlier[-1:])
    return sorted(found - {None}, key=parse)


def measured_reproduction(fix_id: str, release: str) -> bool | None:
    """What the entry's ``reproduce()`` returned in the sweep's row of ``release`` (None: it did not run there)."""
    return fixes.get(fix_id).info.sweep.observations[release].reproduced


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_an_entry_is_registered_then_its_metadata_is_complete(entry):
    from fixes.fix import KINDS

    fix = fixes.get(entry)
    info = fix.info
    assert info.id == entry and fix.id == entry
    for field in ("title", "summary", "root_cause"):
        assert getattr(info, field).strip(), f"{field} is empty"
    assert info.symptom in ("crash", "silent wrong result", "hang") and info.kind in KINDS
    assert info.components and all(c.strip() for c in info.components), "no components"
    assert info.error_signatures and all(s.strip() for s in info.error_signatures), "no error signatures"
    assert info.upstream_issues or info.upstream_prs or info.upstream_note.strip(), \
        "no upstream issue or pull request, and no upstream_note saying why"
    named = re.findall(r"deepspeed/[\w/]+\.py", info.root_cause)
    assert named, "the root cause must name the DeepSpeed file (deepspeed/....py)"
    source = releases.install_dir(info.reproduce_release)
    missing = [path for path in named if not (source / path).is_file()]
    assert not missing, f"the root cause names files DeepSpeed {info.reproduce_release} does not have: {missing}"
    assert info.reproduce_release in known_releases(), "the reproduce release is not one ci/setup.sh installs"
    assert info.expected_affected(releases.load().newest) is not None, "the newest release was not swept"
    if info.reproduced_here:
        assert info.expected_affected(info.reproduce_release), "the reproduce release was not measured affected"
    assert fix.targets, "a fix must declare the targets its drift check covers"
    assert runner.notebook_path(entry).is_file(), f"no notebook {runner.notebook_path(entry)}"


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_probed_on_releases_measured_affected_then_the_probe_finds_the_bug(entry):
    found = affected_releases(entry)
    assert fixes.get(entry).info.reproduce_release in found
    for release in found:
        assert fixes.get(entry).info.expected_affected(release) is True, f"{release} was not measured affected"
        if release not in rechecked_by_the_sweep(entry):
            call_in_release(release, checks.check_probe, args=(entry, True))  # reproduce(): the next test


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_probed_on_releases_measured_unaffected_then_the_probe_finds_no_bug(entry):
    found = unaffected_releases(entry)
    info = fixes.get(entry).info
    if not found:  # affected on every release swept: the matrix has no unaffected release to agree with
        swept = [r for r in known_releases() if info.expected_affected(r) is not None]
        assert swept and all(info.expected_affected(r) for r in swept), \
            f"{entry}: no unaffected release chosen, though the sweep measured one unaffected"
        # no release was measured unaffected: every release before the first affected one could not run
        assert info.sweep.first_fixed is None and all(
            info.expected_affected(r) is None for r in info.sweep.releases
            if parse(r) < parse(info.sweep.first_affected)), f"{entry}: an older release was measured unaffected"
        newest = releases.load().newest
        call_in_release(newest, checks.check_probe, args=(entry, True, measured_reproduction(entry, newest)),
                        timeout=600)
        return
    for release in found:
        assert info.expected_affected(release) is False, f"{release} was not measured unaffected"
        if release not in rechecked_by_the_sweep(entry):
            call_in_release(release, checks.check_probe, args=(entry, False, measured_reproduction(entry, release)),
                            timeout=600)


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_applied_on_an_affected_release_then_idempotent_and_revert_is_exact(entry):
    call_in_release(fixes.get(entry).info.reproduce_release, checks.check_apply_revert, args=(entry,))


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_applied_on_releases_measured_affected_then_its_reproduction_no_longer_shows_the_bug(entry):
    for release in affected_releases(entry):
        observation = fixes.get(entry).info.sweep.observations[release]
        assert observation.reproduced in (True, None), f"the sweep's reproduce() on {release}"
        assert observation.fix in ("fixed", "refused", None), f"the sweep measured the fix {observation.fix} on {release}"
        if release in rechecked_by_the_sweep(entry):
            continue
        if observation.fix == "refused":  # the sweep measured the fix refusing this release's code: it must still
            call_in_release(release, checks.check_refused_and_still_reproduces, args=(entry,), timeout=600)
            continue
        call_in_release(release, checks.check_reproduction, args=(entry,), timeout=600)


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_a_target_drifted_then_drift_error_and_nothing_patched(entry):
    call_in_release(fixes.get(entry).info.reproduce_release, checks.check_drift_refused, args=(entry,))


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_applied_on_a_release_measured_unaffected_then_a_noop_that_says_why(entry):
    found = unaffected_releases(entry)
    if not found:  # as above: no release to be a no-op on; on the newest the fix must apply and revert exactly
        assert fixes.get(entry).info.expected_affected(releases.load().newest) is True
        call_in_release(releases.load().newest, checks.check_apply_revert, args=(entry,))
        return
    for release in found:
        call_in_release(release, checks.check_noop_on_unaffected_release, args=(entry,))


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_its_trigger_is_read_then_it_agrees_with_every_cell_of_its_measured_grid(entry):
    from ci.sweep import triggers

    assert fixes.get(entry).trigger is not None, f"no trigger: fixes/entries/{entry.replace('-', '_')}/trigger.py"
    assert triggers.problems([entry]) == []


@pytest.mark.parametrize("entry", ENTRIES)
def test_when_its_notebook_tests_are_selected_then_only_its_runs_execute(entry):
    from tests.conftest import runs_needed

    info, newest = fixes.get(entry).info, releases.load().newest
    mine = runner.matrix([entry])
    assert {(entry, info.reproduce_release, "cpu"), (entry, newest, "cpu")} <= set(mine)
    assert all(run[0] == entry for run in mine)
    every = full_matrix()
    # `pytest tests/notebooks -k <id>` selects the tests whose id (entry@release-environment) names the entry
    selected = [run for run in every if entry in f"{run[0]}@{run[1]}-{run[2]}"]
    assert {run[0] for run in selected} == {entry}, f"-k {entry} also selects {sorted({r[0] for r in selected})}"
    items = [SimpleNamespace(fixturenames=("matrix_build",), get_closest_marker=lambda name: None,
                             callspec=SimpleNamespace(params=dict(zip(("entry", "release", "environment"), run))))
             for run in selected]
    assert runs_needed(items, every) == mine
