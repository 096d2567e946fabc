"""bf16-zero0-grads-never-zeroed on its reproduce release (0.18.4: gradients never zeroed and divided by 65536),
on the first affected one (0.17.6: never zeroed, the loss still scaled by engine.backward), and on the newest
(fixed) one, in child processes."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.4"
FIRST_AFFECTED = "0.17.6"
FIX_ID = "bf16-zero0-grads-never-zeroed"
OPTIMIZER_CHOICE = "bf16-gets-fp16-optimizer"


def _engine_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _run(job):
    from fixes.entries.bf16_zero0_grads_never_zeroed import reproduce as repro

    return repro.versus("check", job, repro.run_two_ranks(job))


def check_reproduces_then_the_fix_repairs_it_and_revert_brings_it_back():
    import fixes
    from fixes.entries.bf16_zero0_grads_never_zeroed.reproduce import bf16_zero0_job, reproduce

    _engine_class()
    assert reproduce() is True
    broken = _run(bf16_zero0_job(micro_steps=2))
    rank0 = broken["ranks"][0]
    assert rank0["optimizer"] == "FP16_UnfusedOptimizer" and rank0["loss_scale"] == 65536.0, rank0
    assert all(rank0["grads_left_after_step"]) and not broken["close"]
    fixes.apply(FIX_ID)
    assert reproduce() is False
    for job in (bf16_zero0_job(micro_steps=2), bf16_zero0_job(optimizer="adam", lr=0.01)):
        fixed = _run(job.with_(fixes=(FIX_ID,)))
        rank0 = fixed["ranks"][0]
        assert rank0["loss_scale"] == 1.0 and not any(rank0["grads_left_after_step"]), rank0
        assert fixed["close"], (fixed["params"], fixed["grad_norms"])
    fixes.revert(FIX_ID)
    assert reproduce() is True


def check_the_optimizer_fix_alone_changes_nothing_here():
    import fixes
    from fixes.entries.bf16_zero0_grads_never_zeroed.reproduce import bf16_zero0_job

    _engine_class()
    job = bf16_zero0_job()
    without = _run(job)
    with_optimizer_fix = _run(job.with_(fixes=(OPTIMIZER_CHOICE,)))
    assert with_optimizer_fix["ranks"][0]["optimizer"] == "FP16_UnfusedOptimizer"
    assert not with_optimizer_fix["close"]
    assert with_optimizer_fix["params"].max_abs_diff == without["params"].max_abs_diff
    fixes.revert(OPTIMIZER_CHOICE)


def check_first_affected_release_accumulates_and_the_fix_repairs_it():
    import fixes
    from fixes.entries.bf16_zero0_grads_never_zeroed.reproduce import bf16_zero0_job

    _engine_class()
    one_step = _run(bf16_zero0_job(steps=1))  # engine.backward still scales the loss: one step is right ...
    assert one_step["params"].close, one_step["params"]
    reported, reference = one_step["ranks"][0]["grad_norms"][0], one_step["reference"].grad_norms[0]
    assert abs(reported / reference - 65536) < 65536 * 1e-2, (reported, reference)  # ... but its norm is scaled
    three = _run(bf16_zero0_job())
    assert all(three["ranks"][0]["grads_left_after_step"]) and not three["params"].close
    fixes.apply(FIX_ID)
    fixed = _run(bf16_zero0_job().with_(fixes=(FIX_ID,)))
    assert fixed["close"] and fixed["ranks"][0]["loss_scale"] == 1.0, fixed["params"]
    fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    def _take_model_step(self, lr_kwargs, block_eigenvalue={}):  # drifted
        if self.bfloat16_enabled():
            if self.zero_optimization() and hasattr(self.optimizer, "zero_grad"):  # the bug kept
                self.optimizer.zero_grad()

    engine_class = _engine_class()
    before = vars(engine_class)["_configure_fp16_optimizer"]
    assert_drift_refused(FIX_ID, engine_class, "_take_model_step", _take_model_step)
    assert vars(engine_class)["_configure_fp16_optimizer"] is before  # nothing patched


def check_fixed_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _engine_class())
    assert not fixes.get(FIX_ID).reproduce()


def test_when_applied_then_two_ranks_train_like_plain_data_parallel_and_revert_brings_the_bug_back():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it_and_revert_brings_it_back)


def test_when_only_the_optimizer_choice_fix_is_applied_then_the_bug_remains():
    call_in_release(AFFECTED, check_the_optimizer_fix_alone_changes_nothing_here)


def test_when_first_affected_release_then_gradients_accumulate_and_the_fix_repairs_it():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_accumulates_and_the_fix_repairs_it)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
