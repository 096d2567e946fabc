"""bf16-gets-fp16-optimizer beyond the contract and the notebook (0.18.4, ZeRO 0-2, SGD and Adam vs plain PyTorch): the
first affected release (0.17.6), whose engine.backward still goes through optimizer.backward."""
from tests.helpers import call_in_release

FIX_ID = "bf16-gets-fp16-optimizer"


def check_first_affected_release_is_repaired_without_the_scaler_attributes():
    import fixes
    from fixes import harness
    from fixes.entries.bf16_gets_fp16_optimizer.reproduce import bf16_fp32_accumulation_job

    harness.setup()
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    fixes.apply(FIX_ID)
    assert "scale_if_loss" not in vars(BF16_Optimizer)  # engine.backward calls optimizer.backward here
    job = bf16_fp32_accumulation_job(optimizer="adam")
    assert type(harness.build_engine(job).optimizer).__name__ == "BF16_Optimizer"
    run = harness.versus_reference("fixed", job)
    harness.assert_close(run.deepspeed.params, run.reference.params, "bfloat16", run.params.name)


def test_when_first_affected_release_then_fix_repairs_it():
    call_in_release("0.17.6", check_first_affected_release_is_repaired_without_the_scaler_attributes)
