"""load-checkpoint-refresh-fp32-params-missing beyond the contract and the notebook (0.16.0, the warm start with Adam
and SGD vs plain PyTorch): a load that raises, and a full load_checkpoint with the fix applied."""
from tests.helpers import call_in_release


def check_the_no_op_attribute_is_removed_even_when_the_load_raises():
    import tempfile

    import pytest
    import torch

    import fixes
    from fixes import harness
    from fixes.entries.load_checkpoint_refresh_fp32_params_missing import reproduce as entry
    from fixes.harness.resume import resumed

    harness.setup()
    fixes.apply("load-checkpoint-refresh-fp32-params-missing")
    resumed(entry.warm_start_job(), entry.SAVED_AFTER)  # a full load_checkpoint goes straight to the original method
    engine, seen = harness.build_engine(entry.warm_start_job()), []

    def failing_load(*args, **kwargs):
        seen.append(callable(vars(engine.optimizer).get("refresh_fp32_params")))
        raise RuntimeError("load failed")

    with tempfile.TemporaryDirectory() as checkpoint_dir:
        engine.save_checkpoint(checkpoint_dir)
        engine.load_module_state_dict = failing_load
        with pytest.raises(RuntimeError, match="load failed"):
            engine.load_checkpoint(checkpoint_dir, load_module_only=True)
    assert seen == [True], seen  # the wrapper was on the path, with its no-op in place
    assert "refresh_fp32_params" not in vars(engine.optimizer)
    assert isinstance(engine.optimizer, torch.optim.Adam)


def test_when_the_load_raises_or_is_a_full_load_then_the_optimizer_is_left_as_it_was():
    call_in_release("0.16.0", check_the_no_op_attribute_is_removed_even_when_the_load_raises)
