"""ds-to-universal-zero3-sub-groups on its affected releases (0.17.6, and 0.16.0 for the loader, whose swap code
differs there) and on the newest (fixed) one, in child processes."""
import pytest

from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.17.6"
OLDEST = "0.16.0"  # the loader's other affected variant (0.16.0 - 0.16.3)
LOADER_ERROR = "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"
FIX_ID = "ds-to-universal-zero3-sub-groups"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.ds_to_universal_zero3_sub_groups import _EXTRACT

    return _EXTRACT.owner_and_name()[0]


def extract_zero_shards_stage3(optim_files, param_shapes, dp_degree, temp_dir, dp_index, strict=True):
    """A drifted extract_zero_shards_stage3 (a new keyword) that still reads only the first sub-group."""
    import torch

    state_dict = torch.load(optim_files[dp_index], map_location="cpu", weights_only=False)
    return state_dict["optimizer_state_dict"]["fp32_flat_groups"][0]


def check_without_the_loader_a_universal_checkpoint_with_sub_groups_does_not_load():
    """The conversion fixed, the loader as the release has it: load_checkpoint raises the ValueError."""
    import tempfile

    import fixes
    from fixes.harness import build_engine, make_batches, universal
    from fixes.harness.resume import train_steps

    _owner()
    job = universal.sub_group_job(steps=2)
    with tempfile.TemporaryDirectory() as directory:
        engine = build_engine(job)
        train_steps(engine, job, make_batches(job.model, job.steps), range(job.steps))
        engine.save_checkpoint(directory)
        fixes.apply(FIX_ID)
        universal.convert(directory)
        fixes.revert(FIX_ID)
        fresh = build_engine(universal.sub_group_job(steps=2, load_universal=True))
        try:
            fresh.load_checkpoint(directory)
        except ValueError as error:
            assert LOADER_ERROR in str(error), error
        else:
            raise AssertionError("the release's own loader loaded a universal checkpoint with several sub-groups")


def check_resume_from_universal_equals_uninterrupted_and_pytorch():
    """Issue 16's check: 2 steps, save, convert, load into a fresh engine, 2 more = 4 uninterrupted = plain PyTorch
    (weights, exp_avg, exp_avg_sq, each sub-group's step), float32 and bfloat16, each under its tolerance."""
    import fixes
    from fixes.harness import universal

    _owner()
    fixes.apply(FIX_ID)
    try:
        for dtype in ("float32", "bfloat16"):
            comparisons = universal.resume_equivalence(steps=4, saved_after=2, dtype=dtype)
            for label, comparison in comparisons.items():
                print(f"[{dtype}] {label}: max abs diff {comparison.max_abs_diff:.3e}")
            assert all(c.close for c in comparisons.values()), [str(c) for c in comparisons.values() if not c.close]
            assert {"resumed vs PyTorch: step", "resumed vs uninterrupted: exp_avg_sq"} <= set(comparisons)
    finally:
        fixes.revert(FIX_ID)


def check_two_ranks_resume_from_universal_like_plain_pytorch_data_parallel():
    """Two ranks on different data: 2 steps, save, rank 0 converts, both load and take 2 more; every sub-group's
    step is 4 and the weights are plain PyTorch's (data parallel over the two ranks' data)."""
    import tempfile

    import fixes
    from fixes.harness import assert_close, launch, universal

    _owner()
    fixes.apply(FIX_ID)
    try:
        with tempfile.TemporaryDirectory() as directory:
            ranks = launch(universal.rank_resumes, 2, directory, 4, 2)
    finally:
        fixes.revert(FIX_ID)
    reference = universal.reference_state(4, world_size=2)
    for rank in ranks:
        assert rank["steps"] == [4.0] * len(rank["steps"]) and len(rank["steps"]) > 1, rank["steps"]
        assert_close(rank["weights"], reference["weights"], "float32", "[2 ranks] resumed vs plain PyTorch")


def check_drifted_loader_raises_and_patches_nothing():
    from fixes.entries.ds_to_universal_zero3_sub_groups import _LOADER

    owner, name = _LOADER.owner_and_name()
    original = getattr(owner, name)

    def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, checkpoint_dir, param_shapes, strict=True):
        return original(self, checkpoint_dir, param_shapes)

    _owner()
    assert_drift_refused(FIX_ID, owner, name, load_hp_checkpoint_state_from_checkpoint_dir_stage3)


def check_the_fix_reaches_the_worker_processes_main_forks():
    """The fix in the parent reaches main's forked extract workers; the converted state is the engine's."""
    import tempfile

    import fixes
    from fixes.entries.ds_to_universal_zero3_sub_groups import reproduce as repro

    _owner()
    with tempfile.TemporaryDirectory() as directory:
        trained = repro.saved_engine(directory, steps=2)
        fixes.apply(FIX_ID)
        output = repro.convert(directory, workers=2)
        fixes.revert(FIX_ID)
        comparisons = repro.converted_vs_engine(repro.converted_state(output), trained)
        assert all(c.close for c in comparisons.values()), comparisons
        assert sorted(repro.converted_state(output)) == sorted(trained)


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.ds_to_universal_zero3_sub_groups import _EXTRACT

    owner, name = _EXTRACT.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, extract_zero_shards_stage3)


@pytest.mark.parametrize("release", [AFFECTED, OLDEST])
def test_when_only_the_conversion_is_fixed_then_the_release_loader_raises_the_value_error(release):
    call_in_release(release, check_without_the_loader_a_universal_checkpoint_with_sub_groups_does_not_load)


@pytest.mark.parametrize("release", [AFFECTED, OLDEST])
def test_when_applied_then_resume_from_universal_equals_uninterrupted_and_pytorch(release):
    print(call_in_release(release, check_resume_from_universal_equals_uninterrupted_and_pytorch))


def test_when_applied_then_two_ranks_resume_from_universal_like_plain_pytorch():
    print(call_in_release(AFFECTED, check_two_ranks_resume_from_universal_like_plain_pytorch_data_parallel))


def test_when_loader_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_loader_raises_and_patches_nothing)


def test_when_applied_then_main_with_worker_processes_converts_a_checkpoint_saved_before():
    call_in_release(AFFECTED, check_the_fix_reaches_the_worker_processes_main_forks)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
