"""zero23-no-sync-assertion in child processes: ZeRO-2/3 on the first affected release (0.16.0), and ZeRO-0/1, the
configurations the fix must leave alone, on its reproduce release (0.19.8)."""
from tests.helpers import call_in_release

AFFECTED = "0.19.8"
FIRST_AFFECTED = "0.16.0"
FIX_ID = "zero23-no-sync-assertion"


def check_first_affected_release_zero2_and_zero3_match_plain_pytorch():
    """0.16.0's engine.backward also skips the 1/gas loss scaling inside no_sync: the fix must not set the flag."""
    from fixes import harness
    from fixes.entries.zero23_no_sync_assertion import reproduce as repro

    harness.setup()
    for stage in (2, 3):
        job = repro.job(zero_stage=stage)
        with repro.measurement_context():  # other entries' CPU-only bugs (ZeRO-2 step, ZeRO-3 gather on gloo) fixed
            ranks = harness.launch(repro.with_and_without_no_sync, 2, job.with_(fixes=(FIX_ID,)), timeout=240)
        reference = harness.train_reference(job, world_size=2)
        harness.assert_close(ranks[0]["no_sync"]["params"], reference.params, "float32",
                             f"ZeRO-{stage}: fixed no_sync loop vs plain PyTorch")
        harness.assert_close(ranks[0]["no_sync"]["grad_norms"], reference.grad_norms, "float32",
                             f"ZeRO-{stage}: gradient norms vs plain PyTorch")
        harness.assert_close(ranks[0]["no_sync"]["params"], ranks[0]["plain"]["params"], "float32",
                             f"ZeRO-{stage}: with vs without no_sync")
        harness.assert_close(ranks[1]["no_sync"]["params"], ranks[0]["no_sync"]["params"], "float32",
                             f"ZeRO-{stage}: rank 1 vs rank 0")


def check_zero0_and_zero1_keep_the_original_no_sync():
    import fixes
    from deepspeed.runtime.engine import DeepSpeedEngine
    from fixes import harness
    from fixes.entries.zero23_no_sync_assertion import reproduce as repro

    harness.setup()
    original = vars(DeepSpeedEngine)["no_sync"]
    fixes.apply(FIX_ID)
    for stage in (0, 1):
        engine = harness.build_engine(repro.job(zero_stage=stage, steps=1))
        context = engine.no_sync()
        assert type(context).__name__ == "_GeneratorContextManager", context
        assert context.gen.gi_code is original.__wrapped__.__code__, "not DeepSpeed's own no_sync"
        with context:
            assert engine.inside_no_sync_ctxt
            try:
                with engine.no_sync():
                    pass
            except AssertionError as exc:
                assert "reentry is unsupported" in str(exc), exc
            else:
                raise AssertionError(f"ZeRO-{stage}: nested no_sync was allowed")
        assert not engine.inside_no_sync_ctxt
    for stage in (2, 3):
        engine = harness.build_engine(repro.job(zero_stage=stage, steps=1))
        with engine.no_sync():
            assert not engine.inside_no_sync_ctxt
    job = repro.job(zero_stage=1)  # the ZeRO-1 accelerate loop trains like plain PyTorch, the fix in each rank
    ranks = repro.run_two_ranks(job.with_(fixes=(FIX_ID,)))
    harness.assert_close(ranks[0]["params"], harness.train_reference(job, world_size=2).params, "float32",
                         "ZeRO-1, fixed: no_sync loop vs plain PyTorch")


def test_when_applied_on_first_affected_release_then_zero2_and_zero3_match_plain_pytorch():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_zero2_and_zero3_match_plain_pytorch)


def test_when_applied_then_zero0_and_zero1_keep_deepspeeds_no_sync():
    call_in_release(AFFECTED, check_zero0_and_zero1_keep_the_original_no_sync)
