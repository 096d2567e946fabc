"""fp16-zero0-loss-scale on its reproduce release (0.18.9), on the newest (0.19.8, still affected),
and on the last release whose engine.backward still scales (0.18.2). fp16 runs on the CPU accelerator
through fixes.harness.allow_fp16_on_cpu (build_engine calls it for fp16 jobs)."""
from ci import releases
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
STILL_SCALES = "0.18.2"
FIX_ID = "fp16-zero0-loss-scale"
DYNAMIC = {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}


def _engine_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _sgd(**changes):
    from fixes import harness

    return harness.Job(dtype="float16", optimizer="sgd", lr=0.1, steps=2).with_(**changes)


def _assert_fixed_run_matches_plain_pytorch(job):
    from fixes import harness

    reference = harness.train_reference(job, initial_zero_step=job.zero_stage == 0 and job.optimizer == "adam")
    run = harness.train_deepspeed(job)
    harness.assert_close(run.params, reference.params, "float16", "parameters")
    harness.assert_close(run.losses, reference.losses, "float16", "losses")


def check_fix_makes_sgd_and_adam_match_plain_pytorch_and_revert_brings_the_bug_back():
    import fixes
    from fixes import harness

    _engine_class()
    sgd = _sgd()
    reference = harness.train_reference(sgd)
    harness.assert_differs(harness.train_deepspeed(sgd).params, reference.params, "float16", "unfixed SGD")
    fixes.apply(FIX_ID)
    _assert_fixed_run_matches_plain_pytorch(sgd)
    _assert_fixed_run_matches_plain_pytorch(sgd.with_(optimizer="adam", lr=0.01))
    fixes.revert(FIX_ID)
    harness.assert_differs(harness.train_deepspeed(sgd).params, reference.params, "float16", "reverted")


def check_fix_scales_by_the_dynamic_loss_scale_and_leaves_zero_and_the_returned_loss_alone():
    import torch

    import fixes
    from fixes import harness
    from fixes.entries.fp16_zero0_loss_scale import fp16_loss_scale

    _engine_class()
    fixes.apply(FIX_ID)
    _assert_fixed_run_matches_plain_pytorch(_sgd(config=DYNAMIC))
    _assert_fixed_run_matches_plain_pytorch(_sgd(zero_stage=1))  # ZeRO scales itself: not scaled twice

    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    optimizers = (FP16_Optimizer, FP16_UnfusedOptimizer)
    engine = harness.build_engine(_sgd(config=DYNAMIC))
    assert fp16_loss_scale(engine, optimizers) == 65536.0
    assert fp16_loss_scale(harness.build_engine(_sgd(zero_stage=1)), optimizers) is None
    x, y = harness.make_batches(harness.ModelSpec(), 1).micro(0, 0, 0)
    loss = harness.mse(engine(x.half()), y)
    returned = engine.backward(loss)
    assert torch.equal(returned, loss), (returned, loss)  # what users log stays unscaled
    fixes.revert(FIX_ID)


def check_newest_release_is_still_affected_and_the_fix_repairs_it():
    import fixes
    from fixes import harness

    _engine_class()
    fix = fixes.get(FIX_ID)
    assert fix.probe().affected
    assert fix.reproduce()
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied", outcome
    _assert_fixed_run_matches_plain_pytorch(_sgd())
    _assert_fixed_run_matches_plain_pytorch(_sgd(config=DYNAMIC))
    fixes.revert(FIX_ID)
    assert fix.reproduce()


def check_release_that_still_scales_is_a_noop_and_not_scaled_twice():
    import fixes
    from tests.helpers import snapshot, assert_same_objects

    cls = _engine_class()
    fix = fixes.get(FIX_ID)
    assert not fix.probe().affected and not fix.reproduce()
    before = snapshot(cls)
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "_do_optimizer_backward" in outcome.message, outcome
    assert_same_objects(cls, before)
    _assert_fixed_run_matches_plain_pytorch(_sgd())


def check_fp16_is_allowed_on_the_cpu_accelerator_only_while_asked():
    import torch

    from fixes import harness
    from deepspeed.accelerator import get_accelerator

    harness.setup()
    accelerator = get_accelerator()
    native, native_dtypes = accelerator.is_fp16_supported(), accelerator.supported_dtypes()  # False/None here
    with harness.fp16_on_cpu() as allowed:
        assert allowed and accelerator.is_fp16_supported() and torch.float16 in accelerator.supported_dtypes()
        assert harness.allow_fp16_on_cpu() and harness.fp16_allowed_on_cpu()  # idempotent
    assert accelerator.is_fp16_supported() == native and accelerator.supported_dtypes() == native_dtypes
    assert "is_fp16_supported" not in vars(accelerator) and not harness.fp16_allowed_on_cpu()


def test_when_applied_then_fp16_zero0_sgd_and_adam_match_plain_pytorch():
    call_in_release(AFFECTED, check_fix_makes_sgd_and_adam_match_plain_pytorch_and_revert_brings_the_bug_back)


def test_when_loss_scale_is_dynamic_then_fix_scales_by_the_current_scale_and_zero_is_untouched():
    call_in_release(AFFECTED, check_fix_scales_by_the_dynamic_loss_scale_and_leaves_zero_and_the_returned_loss_alone)


def test_when_newest_release_then_still_affected_and_the_fix_repairs_it():
    call_in_release(releases.load().newest, check_newest_release_is_still_affected_and_the_fix_repairs_it)


def test_when_engine_backward_still_scales_then_apply_is_a_noop_and_training_is_right():
    call_in_release(STILL_SCALES, check_release_that_still_scales_is_a_noop_and_not_scaled_twice)


def test_when_fp16_is_allowed_on_cpu_then_only_inside_the_block():
    call_in_release(AFFECTED, check_fp16_is_allowed_on_the_cpu_accelerator_only_while_asked)
