"""zero12-checkpoint-zero-dim-state on its reproduce release (0.17.6) and on the newest (fixed) one, in child
processes."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, call_in_release)

AFFECTED = "0.17.6"
FIX_ID = "zero12-checkpoint-zero-dim-state"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.zero12_checkpoint_zero_dim_state import _TARGET

    return _TARGET.owner_and_name()[0]


def check_protocol_on_affected_release():
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, _owner())


def check_reproduces_then_the_fix_repairs_it_and_revert_brings_it_back():
    import fixes
    from fixes.entries.zero12_checkpoint_zero_dim_state.reproduce import reproduce

    _owner()
    assert reproduce() is True
    fixes.apply(FIX_ID)
    assert reproduce() is False
    fixes.revert(FIX_ID)
    assert reproduce() is True


def check_the_fix_keeps_zero_dim_tensors_and_slices_the_rest():
    import torch

    import fixes

    owner = _owner()
    optimizer = owner.__new__(owner)  # the method reads nothing of the optimizer
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0), "note": 7, "exp_avg_sq": torch.ones(6)}
    try:
        owner._get_state_without_padding(optimizer, state, 2)
    except IndexError as error:
        assert "0-dim" in str(error), error
    else:
        raise AssertionError("the installed _get_state_without_padding sliced a 0-dim tensor")
    fixes.apply(FIX_ID)
    lean = owner._get_state_without_padding(optimizer, state, 2)
    assert list(lean) == list(state)  # the state's key order
    assert lean["step"] is state["step"] and lean["note"] == 7
    assert torch.equal(lean["exp_avg"], torch.arange(4.0)) and torch.equal(lean["exp_avg_sq"], torch.ones(4))
    without_scalars = {"exp_avg": torch.arange(6.0)}
    assert torch.equal(owner._get_state_without_padding(optimizer, without_scalars, 1)["exp_avg"], torch.arange(5.0))
    fixes.revert(FIX_ID)


def check_saved_checkpoint_holds_plain_pytorch_state():
    import numpy as np

    import fixes
    from fixes import harness
    from fixes.entries.zero12_checkpoint_zero_dim_state.reproduce import SAVED_AFTER, elastic_job, save
    from fixes.harness.resume import reference

    _owner()
    fixes.apply(FIX_ID)
    for stage in (1, 2):
        job = elastic_job(stage)
        saved = save(job)
        assert saved.optimizer == "DeepSpeedZeroOptimizer" and saved.in_file["layout"] == "elastic", saved
        plain = reference(job)
        flat_reference = np.concatenate([value.reshape(-1) for value in plain.params.values()])  # parameter order
        harness.assert_close(saved.in_file["weights"], flat_reference, "float32", f"ZeRO-{stage} weights in the file")
        for name in ("exp_avg", "exp_avg_sq", "step"):
            harness.assert_close(saved.in_file[name], plain.state[name], "float32", f"ZeRO-{stage} {name} in the file")
        assert saved.in_file["step"][0] == SAVED_AFTER
    fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    def _get_state_without_padding(self, state_with_padding, padding):  # drifted: the bug kept, code changed
        return {key: value[:value.numel() - padding] for key, value in state_with_padding.items()}

    assert_drift_refused(FIX_ID, _owner(), "_get_state_without_padding", _get_state_without_padding)


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _owner())
    assert fixes.get(FIX_ID).reproduce() is False


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_save_checkpoint_succeeds_and_revert_brings_the_error_back():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it_and_revert_brings_it_back)


def test_when_applied_then_zero_dim_tensors_are_kept_and_the_rest_sliced():
    call_in_release(AFFECTED, check_the_fix_keeps_zero_dim_tensors_and_slices_the_rest)


def test_when_applied_then_the_saved_checkpoint_holds_the_plain_pytorch_state():
    call_in_release(AFFECTED, check_saved_checkpoint_holds_plain_pytorch_state)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
