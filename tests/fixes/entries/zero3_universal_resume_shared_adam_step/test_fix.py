"""zero3-universal-resume-shared-adam-step on its affected release (0.19.8, the newest: open upstream) and on a
release before the loader had the bug (0.17.6), in child processes."""
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.8"
FIRST_AFFECTED = "0.18.2"
BEFORE = "0.17.6"  # the loader fills only the first sub-group; no universal checkpoint with sub-groups converts
FIX_ID = "zero3-universal-resume-shared-adam-step"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.zero3_universal_resume_shared_adam_step import _TARGET

    return _TARGET.owner_and_name()[0]


def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, checkpoint_dir, strict=True):
    """A drifted loader (a new keyword) that still shares one step tensor between the sub-groups."""
    state_step = self.optim_sd["state"][0]["step"]
    for fp32_param in self.fp32_partitioned_groups_flat:
        self.optimizer.state[fp32_param]["step"] = state_step


def check_reproduces_then_the_fix_repairs_it():
    import tempfile

    import fixes
    from fixes.entries.zero3_universal_resume_shared_adam_step import reproduce as repro

    _owner()
    assert repro.reproduce() is True
    fixes.apply(FIX_ID)
    with tempfile.TemporaryDirectory() as directory:
        run = repro.resumed(directory)
    assert not run["shared"] and run["loaded_steps"] == [2.0, 2.0, 2.0] and run["steps"] == [3.0, 3.0, 3.0], run
    assert repro.reproduce() is False
    fixes.revert(FIX_ID)
    assert repro.reproduce() is True


def check_probe_finds_the_shared_step_in_the_loader():
    import fixes

    _owner()
    probe = fixes.get(FIX_ID).probe()
    assert probe.affected and "state_step" in probe.evidence, probe


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.zero3_universal_resume_shared_adam_step import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, load_hp_checkpoint_state_from_checkpoint_dir_stage3)


def check_release_before_the_loader_rewrite_is_a_noop_and_cannot_tell():
    from fixes.exceptions import CannotTellError
    from fixes.entries.zero3_universal_resume_shared_adam_step.reproduce import reproduce

    assert_noop_on_fixed_release(FIX_ID, _owner())
    try:
        reproduce()
    except CannotTellError as exc:
        assert "exceeds dimension size" in str(exc), exc
    else:
        raise AssertionError("a universal checkpoint with several sub-groups was made before 0.18.0")


def test_when_applied_then_each_sub_group_keeps_its_own_step_and_the_resume_is_exact():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it)


def test_when_loader_shares_one_step_tensor_then_the_probe_says_affected():
    call_in_release(FIRST_AFFECTED, check_probe_finds_the_shared_step_in_the_loader)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_predates_the_shared_step_then_apply_is_a_noop_and_reproduce_cannot_tell():
    call_in_release(BEFORE, check_release_before_the_loader_rewrite_is_a_noop_and_cannot_tell)
