"""bf16-zero0-checkpoint-drops-optimizer-state on its reproduce release (0.18.4, silent), on the first affected
one (0.17.6, load_checkpoint raises), and on the newest (fixed) one, in child processes."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.4"
FIRST_AFFECTED = "0.17.6"
FIX_ID = "bf16-zero0-checkpoint-drops-optimizer-state"
OPTIMIZER_CHOICE = "bf16-gets-fp16-optimizer"


def _engine_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _assert_loaded_equals_saved(run):
    from fixes import harness

    harness.assert_close(run.at_load.params, run.at_save.params, "bfloat16", "weights, loaded vs saved")
    for name, value in run.at_save.state.items():
        harness.assert_close(run.at_load.state[name], value, "bfloat16", f"{name}, loaded vs saved")


def check_reproduces_then_the_fix_repairs_it_and_revert_brings_it_back():
    import fixes
    from fixes.entries.bf16_zero0_checkpoint_drops_optimizer_state.reproduce import bf16_zero0_job, reproduce
    from fixes.harness.resume import model_file_entries, resumed

    _engine_class()
    assert reproduce() is True
    fixes.apply(FIX_ID)
    assert reproduce() is False
    written = {}
    run = resumed(bf16_zero0_job(), 3, between=lambda folder: written.update(model_file_entries(folder)))
    assert run.at_save.optimizer == "FP16_UnfusedOptimizer"
    assert [entries["optimizer"] for entries in written.values()] == [True], written  # the state is in the model file
    _assert_loaded_equals_saved(run)
    assert run.end.state["step"][0] == run.at_save.state["step"][0] + 3  # Adam's step count goes on
    fixes.revert(FIX_ID)
    assert reproduce() is True


def check_with_the_optimizer_fix_fp32_accumulation_resumes_like_plain_pytorch():
    import fixes
    from fixes.entries.bf16_zero0_checkpoint_drops_optimizer_state.reproduce import bf16_zero0_job
    from fixes.harness.resume import resume_versus

    _engine_class()
    job = bf16_zero0_job("fp32", fixes=(OPTIMIZER_CHOICE,))
    alone = resume_versus("bf16-gets-fp16-optimizer alone", job, 3)
    assert alone.resumed.optimizer == "BF16_Optimizer"
    assert not alone.load_close and not alone.comparison("saved", "step").close  # its ZeRO file is not read
    fixes.revert(OPTIMIZER_CHOICE)
    both = resume_versus("both fixes", job.with_(fixes=(OPTIMIZER_CHOICE, FIX_ID)), 3)
    assert both.resumed.optimizer == "BF16_Optimizer"
    assert both.close, both.rows()  # loaded = saved, resumed = uninterrupted = plain PyTorch
    fixes.revert(FIX_ID, OPTIMIZER_CHOICE)


def check_first_affected_release_raises_and_the_fix_restores_the_state():
    import fixes
    from fixes.entries.bf16_zero0_checkpoint_drops_optimizer_state.reproduce import (bf16_zero0_job,
                                                                                     load_error_is_this_bug, reproduce)
    from fixes.harness.resume import resume_versus, resumed

    engine_class = _engine_class()
    try:
        resumed(bf16_zero0_job(), 3)
    except AttributeError as error:
        assert load_error_is_this_bug(error), error
    else:
        raise AssertionError("load_checkpoint did not raise on 0.17.6")
    original_load = vars(engine_class)["load_checkpoint"]
    fixes.apply(FIX_ID)
    assert vars(engine_class)["load_checkpoint"] is original_load  # 0.17.6 reads BF16_Optimizer's ZeRO file itself
    assert reproduce() is False
    _assert_loaded_equals_saved(resumed(bf16_zero0_job(), 3))
    both = resume_versus("both fixes", bf16_zero0_job("fp32", fixes=(OPTIMIZER_CHOICE,)), 3)
    assert both.resumed.optimizer == "BF16_Optimizer" and both.close, both.rows()
    fixes.revert(FIX_ID, OPTIMIZER_CHOICE)


def check_drifted_target_raises_and_patches_nothing():
    def _save_checkpoint(self, save_dir, tag, client_state={}, exclude_frozen_parameters=False):  # drifted
        zero_optimizer_state = self.zero_optimization() or self.bfloat16_enabled()  # the bug kept
        return zero_optimizer_state

    engine_class = _engine_class()
    before = vars(engine_class)["_load_checkpoint"]
    assert_drift_refused(FIX_ID, engine_class, "_save_checkpoint", _save_checkpoint)
    assert vars(engine_class)["_load_checkpoint"] is before  # nothing patched


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _engine_class())
    assert not fixes.get(FIX_ID).reproduce()


def test_when_applied_then_the_optimizer_state_is_saved_and_loaded_and_revert_brings_the_bug_back():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it_and_revert_brings_it_back)


def test_when_applied_with_the_optimizer_fix_then_fp32_accumulation_resumes_like_plain_pytorch():
    call_in_release(AFFECTED, check_with_the_optimizer_fix_fp32_accumulation_resumes_like_plain_pytorch)


def test_when_first_affected_release_then_load_raises_and_the_fix_restores_the_state():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_raises_and_the_fix_restores_the_state)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
