"""zero12-checkpoint-zero-dim-state on its reproduce release (0.17.6): the method's edge cases, and ZeRO-2's file (the
notebook saves ZeRO-1's)."""
import numpy as np
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.17.6"
FIX_ID = "zero12-checkpoint-zero-dim-state"


def check_the_fix_keeps_zero_dim_tensors_and_slices_the_rest():
    from fixes.entries.zero12_checkpoint_zero_dim_state import _TARGET

    harness.setup()
    owner = _TARGET.owner_and_name()[0]
    optimizer = owner.__new__(owner)  # the method reads nothing of the optimizer
    state = {"step": torch.tensor(3.0), "exp_avg": torch.arange(6.0), "note": 7, "exp_avg_sq": torch.ones(6)}
    fixes.apply(FIX_ID)
    try:
        lean = owner._get_state_without_padding(optimizer, state, 2)
        assert list(lean) == list(state)  # the state's key order
        assert lean["step"] is state["step"] and lean["note"] == 7
        assert torch.equal(lean["exp_avg"], torch.arange(4.0)) and torch.equal(lean["exp_avg_sq"], torch.ones(4))
        without_scalars = {"exp_avg": torch.arange(6.0)}
        assert torch.equal(owner._get_state_without_padding(optimizer, without_scalars, 1)["exp_avg"],
                           torch.arange(5.0))
    finally:
        fixes.revert(FIX_ID)


def check_saved_zero2_checkpoint_holds_plain_pytorch_state():
    from fixes.entries.zero12_checkpoint_zero_dim_state.reproduce import SAVED_AFTER, elastic_job, save
    from fixes.harness.resume import reference

    harness.setup()
    fixes.apply(FIX_ID)
    job = elastic_job(2)
    saved = save(job)
    assert saved.optimizer == "DeepSpeedZeroOptimizer" and saved.in_file["layout"] == "elastic", saved
    plain = reference(job)
    flat_reference = np.concatenate([value.reshape(-1) for value in plain.params.values()])  # parameter order
    harness.assert_close(saved.in_file["weights"], flat_reference, "float32", "ZeRO-2 weights in the file")
    for name in ("exp_avg", "exp_avg_sq", "step"):
        harness.assert_close(saved.in_file[name], plain.state[name], "float32", f"ZeRO-2 {name} in the file")
    assert saved.in_file["step"][0] == SAVED_AFTER
    fixes.revert(FIX_ID)


def test_when_applied_then_zero_dim_tensors_are_kept_and_the_rest_sliced():
    call_in_release(AFFECTED, check_the_fix_keeps_zero_dim_tensors_and_slices_the_rest)


def test_when_applied_with_zero2_then_the_saved_checkpoint_holds_the_plain_pytorch_state():
    call_in_release(AFFECTED, check_saved_zero2_checkpoint_holds_plain_pytorch_state)
