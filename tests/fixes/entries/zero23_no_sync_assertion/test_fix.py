"""zero23-no-sync-assertion on its reproduce release (the newest: the bug is open upstream) and on the first
affected one, in child processes. There is no fixed release to test a no-op on; ZeRO stage 0/1 are the
configurations the fix must leave alone."""
from tests.helpers import call_in_release

AFFECTED = "0.19.8"
FIRST_AFFECTED = "0.16.0"
FIX_ID = "zero23-no-sync-assertion"
ASSERTION = "no_sync context manager is incompatible with gradient partitioning logic of ZeRO stage {}"


def _engine_class():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def check_reproduces_then_the_fix_repairs_it_and_revert_brings_the_assertion_back():
    import fixes
    from fixes.entries.zero23_no_sync_assertion import reproduce as repro
    from fixes.exceptions import RankFailedError

    _engine_class()
    assert repro.reproduce() is True
    fixes.apply(FIX_ID)
    assert repro.reproduce() is False
    fixes.revert(FIX_ID)
    for stage in (2, 3):
        try:
            repro.run_two_ranks(repro.job(zero_stage=stage, micro_steps=2, steps=1))
        except RankFailedError as exc:
            assert exc.exc_type == "AssertionError" and exc.message == ASSERTION.format(stage), exc
        else:
            raise AssertionError(f"ZeRO-{stage}: no_sync did not raise after revert")


def _fixed_loop_matches_plain_pytorch(stages, dtypes=("float32",)):
    from fixes import harness
    from fixes.entries.zero23_no_sync_assertion import reproduce as repro

    for stage in stages:
        for dtype in dtypes:
            job = repro.job(zero_stage=stage, dtype=dtype)
            # other entries' CPU-only bugs (ZeRO-2 step, ZeRO-3 gather on gloo) fixed where installed
            with repro.measurement_context():
                ranks = harness.launch(repro.with_and_without_no_sync, 2, job.with_(fixes=(FIX_ID,)), timeout=240)
            reference = harness.train_reference(job, world_size=2)
            harness.assert_close(ranks[0]["no_sync"]["params"], reference.params, dtype,
                                 f"ZeRO-{stage} {dtype}: fixed no_sync loop vs plain PyTorch")
            harness.assert_close(ranks[0]["no_sync"]["grad_norms"], reference.grad_norms, dtype,
                                 f"ZeRO-{stage} {dtype}: gradient norms vs plain PyTorch")
            harness.assert_close(ranks[0]["no_sync"]["params"], ranks[0]["plain"]["params"], "float32",
                                 f"ZeRO-{stage} {dtype}: with vs without no_sync")
            harness.assert_close(ranks[1]["no_sync"]["params"], ranks[0]["no_sync"]["params"], "float32",
                                 f"ZeRO-{stage} {dtype}: rank 1 vs rank 0")


def check_fixed_zero2_and_zero3_match_plain_pytorch_in_fp32_and_bf16():
    _engine_class()
    _fixed_loop_matches_plain_pytorch((2, 3), ("float32", "bfloat16"))


def check_first_affected_release_is_fixed_too():
    # 0.16.0's engine.backward also skips the 1/gas loss scaling inside no_sync: the fix must not set the flag
    from tests.fixes.contract_checks import check_apply_revert

    check_apply_revert(FIX_ID)
    _fixed_loop_matches_plain_pytorch((2, 3))


def check_zero0_and_zero1_keep_the_original_no_sync():
    import fixes
    from fixes import harness
    from fixes.entries.zero23_no_sync_assertion import reproduce as repro

    engine_class = _engine_class()
    original = vars(engine_class)["no_sync"]
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
    # the ZeRO-1 accelerate loop trains like plain PyTorch, with the fix applied in each rank
    job = repro.job(zero_stage=1)
    ranks = repro.run_two_ranks(job.with_(fixes=(FIX_ID,)))
    harness.assert_close(ranks[0]["params"], harness.train_reference(job, world_size=2).params, "float32",
                         "ZeRO-1, fixed: no_sync loop vs plain PyTorch")
    fixes.revert(FIX_ID)


def test_when_applied_then_no_sync_no_longer_raises_and_revert_brings_the_assertion_back():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it_and_revert_brings_the_assertion_back)


def test_when_fixed_then_zero2_and_zero3_with_no_sync_match_plain_pytorch():
    call_in_release(AFFECTED, check_fixed_zero2_and_zero3_match_plain_pytorch_in_fp32_and_bf16)


def test_when_applied_on_first_affected_release_then_zero2_and_zero3_match_plain_pytorch():
    call_in_release(FIRST_AFFECTED, check_first_affected_release_is_fixed_too)


def test_when_applied_then_zero0_and_zero1_keep_deepspeeds_no_sync():
    call_in_release(AFFECTED, check_zero0_and_zero1_keep_the_original_no_sync)
