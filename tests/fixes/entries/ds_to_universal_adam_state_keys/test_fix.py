"""What is specific to ds-to-universal-adam-state-keys, in child processes of a release (``call_in_release``). Every
check every entry must pass (metadata, probe against the sweep, apply/revert exact, drift refused, no-op where
unaffected, its trigger and notebook) is tests/fixes/test_contract.py's: it runs on this entry with nothing written
here."""
from tests.helpers import call_in_release

AFFECTED = "0.19.8"
OLDEST = "0.16.0"
FIX_ID = "ds-to-universal-adam-state-keys"


def check_sgd_and_adam_resume_through_a_universal_checkpoint_as_plain_pytorch():
    import fixes
    from fixes import harness
    from fixes.entries.ds_to_universal_adam_state_keys import reproduce as repro

    harness.setup()
    before = repro.outcome(repro.job())
    assert before["bug"] and before["error"] == "KeyError: 'exp_avg'", before
    fixes.apply(FIX_ID)
    try:
        for zero_stage in (1, 2):
            for optimizer, momentum in (("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)):
                found = repro.outcome(repro.job(zero_stage=zero_stage, optimizer=optimizer), momentum)
                assert not found["error"] and found["weights"].close, (zero_stage, optimizer, momentum, found)
    finally:
        fixes.revert(FIX_ID)


def check_adam_converts_to_the_same_files_with_the_fix():
    """Adam's universal checkpoint holds the same state files, with equal tensors, with and without the fix."""
    import os
    import tempfile

    import torch

    import fixes
    from fixes import harness
    from fixes.entries.ds_to_universal_adam_state_keys import reproduce as repro
    from fixes.harness.resume import train_steps

    harness.setup()
    run = repro.job(optimizer="adam")

    def converted(fixed: bool) -> dict:
        with tempfile.TemporaryDirectory() as directory:
            engine = harness.build_engine(run)
            train_steps(engine, run, harness.make_batches(run.model, run.steps), range(2))
            engine.save_checkpoint(directory)
            if fixed:
                fixes.apply(FIX_ID)
            try:
                universal = repro.to_universal(directory)
            finally:
                fixes.revert(FIX_ID)
            found = {}
            for root, _, names in os.walk(os.path.join(universal, "zero")):
                for name in names if root != os.path.join(universal, "zero") else ():  # each parameter's states
                    saved = torch.load(os.path.join(root, name), weights_only=False)
                    found[os.path.relpath(os.path.join(root, name), universal)] = (
                        saved if isinstance(saved, dict) else {"": saved})
            return found

    without, with_fix = converted(False), converted(True)
    assert sorted(without) == sorted(with_fix) and any(name.endswith("exp_avg_sq.pt") for name in without)
    for name, saved in without.items():
        assert sorted(saved) == sorted(with_fix[name]), name
        for key, value in saved.items():
            assert (torch.equal(value, with_fix[name][key]) if torch.is_tensor(value)
                    else value == with_fix[name][key]), (name, key)


def test_when_the_fix_is_applied_then_sgd_with_and_without_momentum_and_adam_resume_as_plain_pytorch():
    call_in_release(AFFECTED, check_sgd_and_adam_resume_through_a_universal_checkpoint_as_plain_pytorch)


def test_when_adam_is_converted_then_the_fix_changes_no_file():
    call_in_release(OLDEST, check_adam_converts_to_the_same_files_with_the_fix)
