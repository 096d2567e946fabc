"""bf16-zero0-grads-never-zeroed beyond the contract and the notebook (0.18.4, SGD and Adam, gas 1 and 2, two ranks vs
plain data parallel): bf16-gets-fp16-optimizer's fix alone, and the first affected release (0.17.6: never zeroed, the
loss still scaled by engine.backward)."""
from tests.helpers import call_in_release

FIX_ID = "bf16-zero0-grads-never-zeroed"
OPTIMIZER_CHOICE = "bf16-gets-fp16-optimizer"


def _setup():
    """(bf16_zero0_job, run(job): two ranks against plain data parallel)."""
    from fixes import harness
    from fixes.entries.bf16_zero0_grads_never_zeroed import reproduce as repro

    harness.setup()
    return repro.bf16_zero0_job, lambda job: repro.versus("check", job, repro.run_two_ranks(job))


def check_the_optimizer_fix_alone_changes_nothing_here():
    bf16_zero0_job, run = _setup()
    without = run(bf16_zero0_job())
    with_optimizer_fix = run(bf16_zero0_job().with_(fixes=(OPTIMIZER_CHOICE,)))
    assert with_optimizer_fix["ranks"][0]["optimizer"] == "FP16_UnfusedOptimizer"
    assert not with_optimizer_fix["close"]
    assert with_optimizer_fix["params"].max_abs_diff == without["params"].max_abs_diff


def check_first_affected_release_accumulates_and_the_fix_repairs_it():
    bf16_zero0_job, run = _setup()
    one_step = run(bf16_zero0_job(steps=1))  # engine.backward still scales the loss: one step is right ...
    assert one_step["params"].close, one_step["params"]
    reported, reference = one_step["ranks"][0]["grad_norms"][0], one_step["reference"].grad_norms[0]
    assert abs(reported / reference - 65536) < 65536 * 1e-2, (reported, reference)  # ... but its norm is scaled
    three = run(bf16_zero0_job())
    assert all(three["ranks"][0]["grads_left_after_step"]) and not three["params"].close
    fixed = run(bf16_zero0_job().with_(fixes=(FIX_ID,)))
    assert fixed["close"] and fixed["ranks"][0]["loss_scale"] == 1.0, fixed["params"]


def test_when_only_the_optimizer_choice_fix_is_applied_then_the_bug_remains():
    call_in_release("0.18.4", check_the_optimizer_fix_alone_changes_nothing_here)


def test_when_first_affected_release_then_gradients_accumulate_and_the_fix_repairs_it():
    call_in_release("0.17.6", check_first_affected_release_accumulates_and_the_fix_repairs_it)
