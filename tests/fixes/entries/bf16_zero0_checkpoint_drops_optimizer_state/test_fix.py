"""bf16-zero0-checkpoint-drops-optimizer-state beyond the contract and the notebook (0.18.4, loaded vs saved in each
configuration): where the state is written and that Adam's step goes on, bf16-gets-fp16-optimizer's fix alone, and the
first affected release (0.17.6, where load_checkpoint raises)."""
from tests.helpers import call_in_release

FIX_ID = "bf16-zero0-checkpoint-drops-optimizer-state"
OPTIMIZER_CHOICE = "bf16-gets-fp16-optimizer"


def _setup():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_zero0_checkpoint_drops_optimizer_state import reproduce
    from fixes.harness import resume

    harness.setup()
    return fixes, harness, reproduce, resume


def check_the_state_goes_into_the_model_file_and_the_optimizer_fix_alone_does_not_resume():
    fixes, _, repro, resume = _setup()
    job = repro.bf16_zero0_job("fp32", fixes=(OPTIMIZER_CHOICE,))
    alone = resume.resume_versus("bf16-gets-fp16-optimizer alone", job, 3)
    assert alone.resumed.optimizer == "BF16_Optimizer"
    assert not alone.load_close and not alone.comparison("saved", "step").close  # its ZeRO file is not read
    fixes.revert(OPTIMIZER_CHOICE)
    fixes.apply(FIX_ID)
    written = {}
    run = resume.resumed(repro.bf16_zero0_job(), 3,
                         between=lambda folder: written.update(resume.model_file_entries(folder)))
    assert run.at_save.optimizer == "FP16_UnfusedOptimizer"
    assert [entries["optimizer"] for entries in written.values()] == [True], written  # the state is in the model file
    assert run.end.state["step"][0] == run.at_save.state["step"][0] + 3  # Adam's step count goes on


def check_first_affected_release_raises_and_the_fix_restores_the_state():
    fixes, harness, repro, resume = _setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    try:
        resume.resumed(repro.bf16_zero0_job(), 3)
    except AttributeError as error:
        assert repro.load_error_is_this_bug(error), error
    else:
        raise AssertionError("load_checkpoint did not raise on 0.17.6")
    original_load = vars(DeepSpeedEngine)["load_checkpoint"]
    fixes.apply(FIX_ID)
    assert vars(DeepSpeedEngine)["load_checkpoint"] is original_load  # 0.17.6 reads BF16_Optimizer's ZeRO file itself
    run = resume.resumed(repro.bf16_zero0_job(), 3)
    harness.assert_close(run.at_load.params, run.at_save.params, "bfloat16", "weights, loaded vs saved")
    for name, value in run.at_save.state.items():
        harness.assert_close(run.at_load.state[name], value, "bfloat16", f"{name}, loaded vs saved")
    both = resume.resume_versus("both fixes", repro.bf16_zero0_job("fp32", fixes=(OPTIMIZER_CHOICE,)), 3)
    assert both.resumed.optimizer == "BF16_Optimizer" and both.close, both.rows()


def test_when_applied_then_the_state_is_in_the_model_file_and_the_optimizer_fix_alone_is_not_enough():
    call_in_release("0.18.4", check_the_state_goes_into_the_model_file_and_the_optimizer_fix_alone_does_not_resume)


def test_when_first_affected_release_then_load_raises_and_the_fix_restores_the_state():
    call_in_release("0.17.6", check_first_affected_release_raises_and_the_fix_restores_the_state)
