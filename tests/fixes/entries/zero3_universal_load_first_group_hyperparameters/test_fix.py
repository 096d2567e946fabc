"""What is specific to zero3-universal-load-first-group-hyperparameters, in child processes of a release
(``call_in_release``). Every check every entry must pass (metadata, probe against the sweep, apply/revert exact, drift
refused, no-op where unaffected, its trigger and notebook) is tests/fixes/test_contract.py's: it runs on this entry
with nothing written here."""
from tests.helpers import call_in_release

AFFECTED = "0.19.8"
BEFORE_THE_LOADER = "0.17.6"  # torch's load_state_dict: each group its own (with the sub-groups entry's fix)
FIX_ID = "zero3-universal-load-first-group-hyperparameters"


def check_each_group_resumes_with_its_own_hyperparameters():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_universal_load_first_group_hyperparameters import reproduce as repro

    harness.setup()
    before = repro.outcome(repro.job())
    assert before["loaded"] == [before["saved"][0]] * 2 and not before["weights"].close, before
    fixes.apply(FIX_ID)
    try:
        assert all(fixes.get(needed).applied for needed in fixes.get(FIX_ID).requires)
        for dtype in ("float32", "bfloat16"):
            for groups in (2, 1):
                found = repro.outcome(repro.job(dtype=dtype), groups)
                assert found["loaded"] == found["saved"] and found["weights"].close, (dtype, groups, found)
    finally:
        fixes.revert(FIX_ID)
    assert not any(fixes.get(needed).applied for needed in fixes.get(FIX_ID).requires)


def check_the_loader_before_it_keeps_each_group():
    from fixes import harness
    from fixes.entries.zero3_universal_load_first_group_hyperparameters import reproduce as repro

    harness.setup()
    with repro.measurement_context():
        found = repro.outcome(repro.job())
    assert found["loaded"] == found["saved"] and found["weights"].close, found


def test_when_the_fix_is_applied_then_each_group_resumes_with_its_own_hyperparameters():
    call_in_release(AFFECTED, check_each_group_resumes_with_its_own_hyperparameters)


def test_when_the_release_loads_with_torchs_load_state_dict_then_each_group_keeps_its_own():
    call_in_release(BEFORE_THE_LOADER, check_the_loader_before_it_keeps_each_group)
