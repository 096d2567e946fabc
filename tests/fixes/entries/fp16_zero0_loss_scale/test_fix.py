"""fp16-zero0-loss-scale on its reproduce release (0.18.9), in a child process: the scale the fix multiplies by, the
loss it returns, and fp16 on the CPU accelerator only while the harness allows it."""
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


def check_fp16_is_allowed_on_the_cpu_accelerator_only_while_asked():
    import torch
    from deepspeed.accelerator import get_accelerator
    from fixes import harness

    harness.setup()
    accelerator = get_accelerator()
    native, native_dtypes = accelerator.is_fp16_supported(), accelerator.supported_dtypes()  # False/None here
    with harness.fp16_on_cpu() as allowed:
        assert allowed and accelerator.is_fp16_supported() and torch.float16 in accelerator.supported_dtypes()
        assert harness.allow_fp16_on_cpu() and harness.fp16_allowed_on_cpu()  # idempotent
    assert accelerator.is_fp16_supported() == native and accelerator.supported_dtypes() == native_dtypes
    assert "is_fp16_supported" not in vars(accelerator) and not harness.fp16_allowed_on_cpu()


def test_when_loss_scale_is_dynamic_then_the_fix_scales_by_the_current_scale_and_returns_the_loss_unscaled():
    call_in_release(AFFECTED, check_the_scale_is_the_optimizers_and_the_returned_loss_is_unscaled)


def test_when_fp16_is_allowed_on_cpu_then_only_inside_the_block():
    call_in_release(AFFECTED, check_fp16_is_allowed_on_the_cpu_accelerator_only_while_asked)
