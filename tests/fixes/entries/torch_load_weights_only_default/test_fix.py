"""torch-load-weights-only-default on its reproduce release (0.15.4): what the fix edits, the probe following torch's
default, and the resumed ZeRO-3 and bf16 jobs against plain PyTorch (the notebook's is ZeRO-1)."""
import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.15.4"
FIX_ID = "torch-load-weights-only-default"


def check_the_fix_adds_weights_only_false_to_each_torch_load_and_nothing_else():
    import ast
    import inspect
    import textwrap

    from fixes.entries.torch_load_weights_only_default import (_LOAD, _MODEL_STATES, _OPTIM_STATES,
                                                               _loads_without_weights_only)

    harness.setup()
    targets = (_LOAD, _MODEL_STATES, _OPTIM_STATES)
    originals = {target: target.raw() for target in targets}
    sources = {target: textwrap.dedent(inspect.getsource(target.code())) for target in targets}
    fixes.apply(FIX_ID)
    try:
        for target in targets:
            patched = target.raw()
            assert patched is not originals[target] and inspect.unwrap(patched) is originals[target]
            text = inspect.getsource(patched.__code__)  # the code that runs
            assert not _loads_without_weights_only(ast.parse(text)), text
            assert text.count("weights_only=False") == sources[target].count("torch.load("), text
            # the rest is the installed code: without what the fix added, the source is the original's
            assert text.replace(", weights_only=False", "") == sources[target], text
    finally:
        fixes.revert(FIX_ID)
    assert all(target.raw() is originals[target] for target in targets)


def check_the_probe_follows_torchs_default():
    import os

    harness.setup()
    fix = fixes.get(FIX_ID)
    assert fix.probe().affected
    os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"  # torch's old default: nothing to fix
    try:
        probe = fix.probe()
        assert not probe.affected and "weights_only=False" in probe.evidence, probe
        outcome = fixes.apply(FIX_ID)[0]
        assert outcome.action == "not needed", outcome
    finally:
        del os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"]


def check_resumed_job_matches_plain_pytorch(stage, dtype):
    """Adam, one step, save, a fresh engine loads (with the fix), two more steps: the weights right after loading
    against the saving engine's, and at the end against plain PyTorch's three steps (weights only: the harness reads
    no ZeRO-3 optimizer state; Adam's state shows in the end weights)."""
    from fixes.entries.torch_load_weights_only_default.reproduce import load_fails, resume_job
    from fixes.harness.resume import reference, resumed

    harness.setup()
    job = resume_job(stage, dtype=dtype, steps=3, optimizer="adam", lr=0.01)
    assert load_fails(job)
    fixes.apply(FIX_ID)
    try:
        run = resumed(job, saved_after=1)
    finally:
        fixes.revert(FIX_ID)
    harness.assert_close(run.at_load.params, run.at_save.params, dtype, "loaded vs saved")
    harness.assert_close(run.end.params, reference(job).params, dtype, "resumed vs plain PyTorch")


def test_when_applied_then_each_torch_load_passes_weights_only_false_and_the_code_is_otherwise_the_installed_one():
    call_in_release(AFFECTED, check_the_fix_adds_weights_only_false_to_each_torch_load_and_nothing_else)


def test_when_torch_load_defaults_to_weights_only_false_then_the_probe_says_not_affected():
    call_in_release(AFFECTED, check_the_probe_follows_torchs_default)


def test_when_applied_with_zero3_then_the_resumed_run_matches_plain_pytorch():
    call_in_release(AFFECTED, check_resumed_job_matches_plain_pytorch, args=(3, "float32"), timeout=600)


def test_when_applied_with_bf16_without_zero_then_the_resumed_run_matches_plain_pytorch():
    call_in_release(AFFECTED, check_resumed_job_matches_plain_pytorch, args=(0, "bfloat16"), timeout=600)
