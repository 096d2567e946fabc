"""ds-to-universal-zero3-sub-groups in child processes: why the loader is replaced too (0.17.6 and 0.16.0, whose
loader code differs), resuming on 0.16.0, and two ranks resuming from a universal checkpoint."""
import pytest

from tests.helpers import call_in_release

AFFECTED = "0.17.6"
OLDEST = "0.16.0"  # the loader's other affected variant (0.16.0 - 0.16.3)
FIX_ID = "ds-to-universal-zero3-sub-groups"
RACE = "zero3-gathered-params-cpu-race"  # DeepSpeed's CPU-only gather race, which a two-rank load trips


def check_without_the_loader_a_universal_checkpoint_with_sub_groups_does_not_load():
    """The conversion fixed, the loader as the release has it: load_checkpoint raises the ValueError."""
    import tempfile

    import pytest
    import fixes
    from fixes.entries.ds_to_universal_zero3_sub_groups.reproduce import LOADER_ERROR
    from fixes.harness import build_engine, make_batches, setup, universal
    from fixes.harness.resume import train_steps

    setup()
    job = universal.sub_group_job(steps=2)
    with tempfile.TemporaryDirectory() as directory:
        engine = build_engine(job)
        train_steps(engine, job, make_batches(job.model, job.steps), range(job.steps))
        engine.save_checkpoint(directory)
        fixes.apply(FIX_ID)
        universal.convert(directory)
        fixes.revert(FIX_ID)
        with pytest.raises(ValueError, match=LOADER_ERROR):
            build_engine(universal.sub_group_job(steps=2, load_universal=True)).load_checkpoint(directory)


def check_resume_from_universal_equals_uninterrupted_and_pytorch():
    """2 steps, save, convert, load, 2 more = 4 uninterrupted = plain PyTorch, all Adam state, fp32 and bf16."""
    import fixes
    from fixes.harness import setup, universal

    setup()
    fixes.apply(FIX_ID)
    for dtype in ("float32", "bfloat16"):
        comparisons = universal.resume_equivalence(steps=4, saved_after=2, dtype=dtype)
        assert all(c.close for c in comparisons.values()), [str(c) for c in comparisons.values() if not c.close]
        assert {"resumed vs PyTorch: step", "resumed vs uninterrupted: exp_avg_sq"} <= set(comparisons)


def check_two_ranks_resume_from_universal_like_plain_pytorch_data_parallel():
    """Two ranks on different data: 2 steps, save, rank 0 converts, both load and take 2 more = plain PyTorch."""
    import tempfile

    import fixes
    from fixes.harness import assert_close, launch, setup, universal

    setup()
    # load_checkpoint gathers the ZeRO-3 parameters with GatheredParameters over several of them: on gloo that is
    # zero3-gathered-params-cpu-race (uninitialised weights now and then on a loaded machine), fixed here too
    fixes.apply(FIX_ID, RACE)
    with tempfile.TemporaryDirectory() as directory:
        ranks = launch(universal.rank_resumes, 2, directory, 4, 2)
    fixes.revert(FIX_ID, RACE)
    reference = universal.reference_state(4, world_size=2)
    for rank in ranks:
        assert rank["steps"] == [4.0] * len(rank["steps"]) and len(rank["steps"]) > 1, rank["steps"]
        assert_close(rank["weights"], reference["weights"], "float32", "[2 ranks] resumed vs plain PyTorch")


@pytest.mark.parametrize("release", [AFFECTED, OLDEST])
def test_when_only_the_conversion_is_fixed_then_the_release_loader_raises_the_value_error(release):
    call_in_release(release, check_without_the_loader_a_universal_checkpoint_with_sub_groups_does_not_load)


def test_when_applied_on_the_oldest_loader_then_resume_equals_uninterrupted_and_pytorch():
    call_in_release(OLDEST, check_resume_from_universal_equals_uninterrupted_and_pytorch)


def test_when_applied_then_two_ranks_resume_from_universal_like_plain_pytorch():
    call_in_release(AFFECTED, check_two_ranks_resume_from_universal_like_plain_pytorch_data_parallel)
