"""fp16-zero0-loss-scale on its reproduce release (0.18.9), in a child process: the scale the fix multiplies by and the
loss it returns."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
FIX_ID = "fp16-zero0-loss-scale"


def check_the_scale_is_the_optimizers_and_the_returned_loss_is_unscaled():
    import torch
    import fixes
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from fixes import harness
    from fixes.entries.fp16_zero0_loss_scale import fp16_loss_scale

    harness.setup()
    fixes.apply(FIX_ID)
    sgd, optimizers = harness.Job(dtype="float16", optimizer="sgd", lr=0.1), (FP16_Optimizer, FP16_UnfusedOptimizer)
    engine = harness.build_engine(sgd.with_(config={"fp16": {"enabled": True, "loss_scale": 0,
                                                             "initial_scale_power": 16}}))
    assert fp16_loss_scale(engine, optimizers) == 65536.0  # the current dynamic scale
    assert fp16_loss_scale(harness.build_engine(sgd.with_(zero_stage=1)), optimizers) is None  # ZeRO scales itself
    x, y = harness.make_batches(harness.ModelSpec(), 1).micro(0, 0, 0)
    loss = harness.mse(engine(x.half()), y)
    assert torch.equal(engine.backward(loss), loss)  # what users log stays unscaled


def test_when_loss_scale_is_dynamic_then_the_fix_scales_by_the_current_scale_and_returns_the_loss_unscaled():
    call_in_release(AFFECTED, check_the_scale_is_the_optimizers_and_the_returned_loss_is_unscaled)
