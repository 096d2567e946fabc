"""tiled-mlp-batch-size, in child processes: what the fix replaces, every batch size and uneven tiling, ZeRO 0/1
training on its affected release (0.17.2), and a release without ALST's tiled compute (0.16.0)."""
from tests.helpers import assert_same_objects, call_in_release, snapshot

AFFECTED = "0.17.2"
WITHOUT_TILED_COMPUTE = "0.16.0"  # before deepspeed/runtime/sequence_parallel/ulysses_sp.py
FIX_ID = "tiled-mlp-batch-size"


def _classes():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    return ulysses_sp.TiledMLP, ulysses_sp.SequenceTiledCompute, ulysses_sp.TiledLoss


def check_apply_replaces_both_backwards_and_nothing_else():
    import fixes

    tiled_mlp, tiled_compute, tiled_loss = _classes()
    before = {cls: snapshot(cls) for cls in (tiled_mlp, tiled_compute, tiled_loss)}
    fixes.apply(FIX_ID)
    for cls in (tiled_mlp, tiled_compute):
        changed = [name for name, value in before[cls].items() if vars(cls)[name] is not value]
        assert changed == ["backward"] and isinstance(vars(cls)["backward"], staticmethod), (cls.__name__, changed)
    assert_same_objects(tiled_loss, before[tiled_loss])


def check_gradients_equal_plain_pytorch_for_every_batch_and_uneven_tiles():
    """Batch 1 is right unfixed; fixed, batch 1-3, sequences 12, 10 (tiles 3,3,3,1) and 7 (2,2,2,1) are right."""
    import fixes
    from fixes.entries.tiled_mlp_batch_size import tiled
    from fixes.harness import assert_close

    _classes()
    for tiling in tiled.TILINGS:
        for seq in (12, 10):
            assert_close(tiled.gradients(tiling, "float32", 1, seq), tiled.gradients(None, "float32", 1, seq),
                         "float32", f"unfixed {tiling} batch 1 seq {seq}")
    fixes.apply(FIX_ID)
    for tiling in tiled.TILINGS:
        for batch in (1, 2, 3):
            for seq in (12, 10, 7):
                for dtype in ("float32", "bfloat16"):
                    assert_close(tiled.gradients(tiling, dtype, batch, seq),
                                 tiled.tile_by_tile(tiling, dtype, batch, seq), dtype,
                                 f"{tiling} {dtype} batch {batch} seq {seq} vs tile by tile")
                assert_close(tiled.gradients(tiling, "float32", batch, seq),
                             tiled.gradients(None, "float32", batch, seq), "float32",
                             f"{tiling} batch {batch} seq {seq} vs untiled")


def check_the_fix_trains_like_plain_pytorch_under_zero_0_and_1():
    import fixes
    from fixes.entries.tiled_mlp_batch_size import reproduce, tiled

    _classes()
    fixes.apply(FIX_ID)
    for stage in (0, 1):  # the notebook trains the user's ZeRO-3 job
        for tiling in tiled.TILINGS:
            found = reproduce.differences(reproduce.sweep_job(zero_stage=stage), tiling, 2, 10)
            assert all(c.close for c in found), (stage, tiling, [str(c) for c in found])


def check_release_without_tiled_compute_is_a_noop_and_nothing_reproduces():
    import importlib.util

    import fixes
    from fixes.entries.tiled_mlp_batch_size.reproduce import reproduce, wrong
    from fixes.exceptions import CannotTellError
    from fixes.harness import setup

    setup()
    assert importlib.util.find_spec("deepspeed.runtime.sequence_parallel") is None
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "no deepspeed.runtime.sequence_parallel.ulysses_sp" in outcome.message, \
        outcome
    assert not fixes.get(FIX_ID).applied and reproduce() is False
    try:  # a single run (the trigger grid's) cannot run at all there
        wrong(fixes.get(FIX_ID)._reproduction().sweep_job(), "TiledMLP", 2)
    except CannotTellError as exc:
        assert "no ALST tiled compute" in str(exc), exc
    else:
        raise AssertionError("a TiledMLP run ran on a release without TiledMLP")


def test_when_applied_then_only_the_two_backward_passes_are_replaced():
    call_in_release(AFFECTED, check_apply_replaces_both_backwards_and_nothing_else)


def test_when_applied_then_gradients_equal_plain_pytorch_for_any_batch_dtype_and_uneven_tiles():
    call_in_release(AFFECTED, check_gradients_equal_plain_pytorch_for_every_batch_and_uneven_tiles)


def test_when_applied_then_training_under_zero_0_and_1_matches_plain_pytorch():
    call_in_release(AFFECTED, check_the_fix_trains_like_plain_pytorch_under_zero_0_and_1)


def test_when_release_has_no_tiled_compute_then_apply_is_a_noop():
    call_in_release(WITHOUT_TILED_COMPUTE, check_release_without_tiled_compute_is_a_noop_and_nothing_reproduces)
