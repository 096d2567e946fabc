"""What is specific to zero12-elastic-checkpoint-load-torch-optimizer, in child processes of a release
(``call_in_release``): a resume on two ranks (each rank's state merged from both ranks' files and partitioned again),
and the fix brings the fix it ``requires`` along where that entry's bug is installed. Every check every entry must pass
is tests/fixes/test_contract.py's."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
NEWEST = "0.19.8"  # _partition_base_optimizer_state takes is_partition_state there: the fix leaves it alone
SAVE_BROKEN = "0.17.6"  # zero12-checkpoint-zero-dim-state's bug installed: no elastic checkpoint without its fix
FIX_ID = "zero12-elastic-checkpoint-load-torch-optimizer"
TWO_RANKS = "zero12-flat-buffer-detach"  # its bug stops two ZeRO-1/2 ranks from training where it is installed


def check_two_rank_resume_matches_plain_pytorch():
    import tempfile

    import fixes
    from fixes import harness
    from fixes.entries.zero12_elastic_checkpoint_load_torch_optimizer.reproduce import (SAVED_AFTER, elastic_job,
                                                                                       rank_resumes)

    harness.setup()
    fixes.apply(TWO_RANKS)  # the ranks apply what this process applied
    assert fixes.apply(FIX_ID)[0].action == "applied"
    try:
        for job in (elastic_job(1), elastic_job(2)):
            with tempfile.TemporaryDirectory(prefix="fixbook-elastic-two-ranks-") as directory:
                ranks = harness.launch(rank_resumes, 2, job, directory, timeout=240)
            plain = harness.train_reference(job, world_size=2)
            for rank, found in enumerate(ranks):
                label = f"ZeRO-{job.zero_stage}, rank {rank} of 2"
                for name, value in found["saved"].items():  # this rank's partition: repartitioned on load
                    harness.assert_close(found["loaded"][name], value, "float32", f"{label}: {name}, loaded vs saved")
                assert float(found["loaded"]["step"][0]) == SAVED_AFTER, found["loaded"]["step"]
                harness.assert_close(found["weights"], plain.params, "float32",
                                     f"{label}: weights, resumed vs plain PyTorch")
    finally:
        fixes.revert(FIX_ID)
        fixes.revert(TWO_RANKS)


def check_the_fix_brings_the_save_fix_it_requires():
    import fixes
    from fixes import harness
    from fixes.entries.zero12_elastic_checkpoint_load_torch_optimizer.reproduce import elastic_job, resume

    harness.setup()
    save_fix = fixes.get("zero12-checkpoint-zero-dim-state")
    assert save_fix.probe().affected and not save_fix.applied
    outcome = fixes.apply(FIX_ID)[0]
    try:
        assert outcome.action == "applied" and "zero12-checkpoint-zero-dim-state" in outcome.message, outcome
        for job in (elastic_job(1), elastic_job(2, dtype="bfloat16")):
            run = resume(job)
            assert run.close, run.rows()
    finally:
        fixes.revert(FIX_ID)
    assert not save_fix.applied


def test_when_applied_then_a_two_rank_resume_matches_plain_pytorch():
    call_in_release(AFFECTED, check_two_rank_resume_matches_plain_pytorch)


def test_when_applied_on_the_newest_then_a_two_rank_resume_matches_plain_pytorch():
    call_in_release(NEWEST, check_two_rank_resume_matches_plain_pytorch)


def test_when_the_save_is_broken_too_then_the_fix_applies_the_save_fix_it_requires():
    call_in_release(SAVE_BROKEN, check_the_fix_brings_the_save_fix_it_requires)
