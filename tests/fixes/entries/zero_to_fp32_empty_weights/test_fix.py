"""zero-to-fp32-empty-weights on its affected release and on the newest (fixed) one, in child processes."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.16.0"
FIX_ID = "zero-to-fp32-empty-weights"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.zero_to_fp32_empty_weights import _TARGET

    return _TARGET.owner_and_name()[0]


def to_torch_tensor(state_dict, return_empty_tensor=False, dtype=None):
    """A drifted to_torch_tensor (a new keyword, no shared-tensor handling) that still has the bug:
    it writes into the dict it is given."""
    import torch

    for name, tensor in state_dict.items():
        state_dict[name] = torch.empty(tensor.shape, dtype=dtype or tensor.dtype) if return_empty_tensor else (
            tensor.contiguous())
    return state_dict


def _saved_checkpoint(directory):
    """A one-step ZeRO-2 job saved to ``directory``/checkpoint, with no fix applied; returns the trained weights."""
    import os

    from fixes import harness

    job = harness.Job(zero_stage=2, steps=1)
    engine = harness.build_engine(job)
    x, y = harness.make_batches(job.model, steps=1).micro(0, 0, 0)
    engine.backward(harness.mse(engine(x), y))
    engine.step()
    engine.save_checkpoint(os.path.join(directory, "checkpoint"))
    return harness.gathered_params(engine.module)


def check_a_checkpoint_saved_before_the_fix_is_repaired_by_the_fixed_converter_not_by_its_copied_script():
    import os
    import subprocess
    import sys
    import tempfile

    import fixes
    from fixes.entries.zero_to_fp32_empty_weights.reproduce import converted_vs_trained, load_converted

    owner = _owner()
    with tempfile.TemporaryDirectory() as directory:
        trained = _saved_checkpoint(directory)
        checkpoint = os.path.join(directory, "checkpoint")
        copied = os.path.join(checkpoint, "zero_to_fp32.py")
        with open(copied) as saved, open(owner.__file__) as installed:
            assert saved.read() == installed.read(), "save_checkpoint did not copy the installed zero_to_fp32.py"
        fixes.apply(FIX_ID)
        # The copy in the folder has its own to_torch_tensor: the fix in this process cannot reach it.
        subprocess.run([sys.executable, copied, checkpoint, os.path.join(directory, "by-script")], check=True,
                       capture_output=True)
        assert not converted_vs_trained(load_converted(os.path.join(directory, "by-script")), trained,
                                        "copied script").close
        # The library function, fixed, converts the same folder right.
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(checkpoint, os.path.join(directory, "repaired"))
        assert converted_vs_trained(load_converted(os.path.join(directory, "repaired")), trained, "repaired").close
        fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.zero_to_fp32_empty_weights import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, to_torch_tensor)


def test_when_checkpoint_was_saved_before_the_fix_then_the_fixed_converter_repairs_it():
    call_in_release(AFFECTED, check_a_checkpoint_saved_before_the_fix_is_repaired_by_the_fixed_converter_not_by_its_copied_script)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
