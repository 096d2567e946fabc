"""engine-backward-scale-wrt-gas-ignored on its reproduce release, in child processes: with the fix,
``engine.backward(loss, scale_wrt_gas=False)`` matches plain PyTorch summing the micro-batches' gradients on every
ZeRO stage (and ZeRO-0 fp16), ``engine.backward(loss)`` and a direct ``loss.backward()`` are unchanged, and the fix
composes with fp16-zero0-loss-scale, which wraps the same ``DeepSpeedEngine.backward``, in either order and in
``fixes.apply()`` with no ids."""
from tests.helpers import call_in_release

AFFECTED = "0.18.3"
FIX_ID = "engine-backward-scale-wrt-gas-ignored"
FP16 = "fp16-zero0-loss-scale"


def check_scale_wrt_gas_false_matches_plain_pytorch_on_every_stage():
    import fixes
    from fixes import harness
    from fixes.entries.engine_backward_scale_wrt_gas_ignored.reproduce import base_job, versus_unscaled

    harness.setup()
    assert fixes.get(FIX_ID).probe().affected
    fixes.apply(FIX_ID)
    for stage in (0, 1, 2, 3):
        for micro_steps in (2, 4):
            params, reference, _ = versus_unscaled(base_job(zero_stage=stage, micro_steps=micro_steps))
            harness.assert_close(params, reference, "float32", f"ZeRO-{stage}, gas {micro_steps}")


def check_default_backward_and_direct_backward_unchanged():
    import torch
    import fixes
    from fixes import harness
    from fixes.entries.engine_backward_scale_wrt_gas_ignored.reproduce import base_job, default_backward_differs

    harness.setup()
    fixes.apply(FIX_ID)
    for stage in (0, 2):
        assert not default_backward_differs(base_job(zero_stage=stage)), stage
    # a direct loss.backward() after engine.backward(..., scale_wrt_gas=False) is still divided by gas
    job = base_job(zero_stage=2, steps=1)
    run = harness.versus_reference("direct", job.with_(backward="tensor"))
    harness.assert_close(run.deepspeed.params, run.reference.params, "float32", run.params.name)
    engine = harness.build_engine(job)
    x, y = harness.make_batches(job.model, 1).micro(0, 0, 0)
    loss = harness.mse(engine(x), y)
    assert torch.equal(engine.backward(loss, scale_wrt_gas=False), loss)  # the returned loss, unscaled
    assert engine.__dict__.get("_fixbook_scale_wrt_gas", True) is True  # restored when backward returns


def check_composes_with_fp16_zero0_loss_scale_in_either_order():
    import fixes
    from fixes import harness
    from fixes.entries.engine_backward_scale_wrt_gas_ignored.reproduce import base_job, versus_unscaled

    harness.setup()
    fp16 = base_job(dtype="float16", steps=1)
    for order in ((FP16, FIX_ID), (FIX_ID, FP16)):
        for fix_id in order:
            [outcome] = fixes.apply(fix_id)
            assert outcome.action == "applied", outcome
        params, reference, _ = versus_unscaled(fp16)
        harness.assert_close(params, reference, "float16", f"fp16 ZeRO-0, applied {order}")
        fixes.revert()
        assert not fixes.get(FIX_ID).applied and not fixes.get(FP16).applied
    # fixes.apply() with no ids: both applied, and the job matches
    outcomes = {outcome.fix_id: outcome for outcome in fixes.apply()}
    assert outcomes[FIX_ID].action == "applied", outcomes[FIX_ID]
    # fp16-unfused-grad-norm-scaled (after this entry in id order) requires it and applies it first
    assert outcomes[FP16].action in ("applied", "already applied") and fixes.get(FP16).applied, outcomes[FP16]
    assert fixes.get(FP16).applied_order > fixes.get(FIX_ID).applied_order
    params, reference, _ = versus_unscaled(fp16)
    harness.assert_close(params, reference, "float16", "fp16 ZeRO-0 after fixes.apply()")
    params, reference, _ = versus_unscaled(base_job(zero_stage=1, steps=1))
    harness.assert_close(params, reference, "float32", "ZeRO-1 after fixes.apply()")
    fixes.revert()


def test_when_applied_then_scale_wrt_gas_false_matches_plain_pytorch_on_zero_0_to_3():
    call_in_release(AFFECTED, check_scale_wrt_gas_false_matches_plain_pytorch_on_every_stage)


def test_when_applied_then_default_and_direct_backward_still_divide_by_gas():
    call_in_release(AFFECTED, check_default_backward_and_direct_backward_unchanged)


def test_when_fp16_zero0_loss_scale_wraps_backward_too_then_both_orders_and_apply_all_work():
    call_in_release(AFFECTED, check_composes_with_fp16_zero0_loss_scale_in_either_order)
