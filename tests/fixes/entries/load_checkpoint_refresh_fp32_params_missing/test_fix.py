"""load-checkpoint-refresh-fp32-params-missing on its reproduce release and on the newest (fixed) one, in child
processes."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.16.0"
FIX_ID = "load-checkpoint-refresh-fp32-params-missing"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.load_checkpoint_refresh_fp32_params_missing import _LOAD_FILE

    return _LOAD_FILE.owner_and_name()[0]


def check_the_warm_start_matches_plain_pytorch():
    import numpy as np

    import fixes
    from fixes.entries.load_checkpoint_refresh_fp32_params_missing import reproduce as entry
    from fixes.harness import assert_close
    from fixes.harness.resume import uninterrupted

    _owner()
    fixes.apply(FIX_ID)
    try:
        for optimizer in ("adam", "sgd"):
            job = entry.warm_start_job(optimizer)
            run = entry.warm_start(job)
            assert_close(run.at_load.params, run.at_save.params, "float32", f"{optimizer}: loaded vs saved")
            reference = entry.warm_start_reference(job)
            assert_close(run.end.params, reference.params, "float32", f"{optimizer}: warm start vs PyTorch")
            for name, value in reference.state.items():
                assert_close(run.end.state[name], value, "float32", f"{optimizer}: {name} vs PyTorch")
            whole = uninterrupted(job)
            same = all(np.array_equal(run.end.params[k], whole.params[k]) for k in whole.params)
            # SGD keeps no state: the warm start is the uninterrupted run; Adam restarts its moments at the load
            assert same == (optimizer == "sgd"), optimizer
        # a full load_checkpoint of the same job goes straight to the original method
        from fixes.harness.resume import resumed

        resumed(entry.warm_start_job(), entry.SAVED_AFTER)
    finally:
        fixes.revert(FIX_ID)


def check_the_no_op_attribute_is_removed_even_when_the_load_raises():
    import tempfile

    import pytest
    import torch

    import fixes
    from fixes.entries.load_checkpoint_refresh_fp32_params_missing import reproduce as entry
    from fixes.harness.training import build_engine

    _owner()
    fixes.apply(FIX_ID)
    try:
        engine = build_engine(entry.warm_start_job())
        seen = []

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
    finally:
        fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.load_checkpoint_refresh_fp32_params_missing import _LOAD_FILE

    owner, name = _LOAD_FILE.owner_and_name()

    def _load_checkpoint(self, load_dir, tag, load_module_strict=True, load_optimizer_states=True,
                         load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """A drifted _load_checkpoint that still calls it on any optimizer."""
        if load_module_only and self.optimizer is not None:
            self.optimizer.refresh_fp32_params()

    _owner()
    assert_drift_refused(FIX_ID, owner, name, _load_checkpoint)


def test_when_applied_then_the_warm_start_matches_plain_pytorch():
    call_in_release(AFFECTED, check_the_warm_start_matches_plain_pytorch)


def test_when_the_load_raises_then_the_optimizer_is_left_as_it_was():
    call_in_release(AFFECTED, check_the_no_op_attribute_is_removed_even_when_the_load_raises)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
