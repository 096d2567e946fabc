"""tiled-mlp-batch-size on its affected release, on the newest (fixed) one and on a release without ALST's tiled
compute, in child processes."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.17.2"
WITHOUT_TILED_COMPUTE = "0.16.0"  # before deepspeed/runtime/sequence_parallel/ulysses_sp.py
FIX_ID = "tiled-mlp-batch-size"


def _classes():
    """``(TiledMLP, SequenceTiledCompute, TiledLoss)`` of this release, after ``harness.setup()`` (TiledLoss: None
    where the release has none)."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    return ulysses_sp.TiledMLP, ulysses_sp.SequenceTiledCompute, getattr(ulysses_sp, "TiledLoss", None)


def check_protocol_on_affected_release():
    tiled_mlp, tiled_compute, tiled_loss = _classes()
    others = {cls: snapshot(cls) for cls in (tiled_compute, tiled_loss)}
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, tiled_mlp)
    for cls, before in others.items():
        assert_same_objects(cls, before)


def check_apply_replaces_both_backwards_and_nothing_else():
    import fixes

    tiled_mlp, tiled_compute, tiled_loss = _classes()
    before = {cls: snapshot(cls) for cls in (tiled_mlp, tiled_compute, tiled_loss)}
    fixes.apply(FIX_ID)
    try:
        for cls in (tiled_mlp, tiled_compute):
            changed = [name for name, value in before[cls].items() if vars(cls)[name] is not value]
            assert changed == ["backward"], (cls.__name__, changed)
            assert isinstance(vars(cls)["backward"], staticmethod), cls.__name__
        assert_same_objects(tiled_loss, before[tiled_loss])
    finally:
        fixes.revert(FIX_ID)


def check_the_fixed_gradients_equal_plain_pytorch_for_every_batch_and_uneven_tiles():
    """One block, no engine: batch 1, 2 and 3, a sequence the 4 tiles divide (12) and two they do not (10: tiles of
    3, 3, 3, 1; 7: 2, 2, 2, 1), both tilings. With the fix the output, the input's and the weights' gradients equal
    plain PyTorch tile by tile (``tiled.tile_by_tile``) in float32 and bf16, and the untiled MLP's in float32;
    without it batch 2 differs in both dtypes."""
    import fixes
    from fixes.entries.tiled_mlp_batch_size import tiled
    from fixes.harness import assert_close, compare

    _classes()
    for tiling in tiled.TILINGS:
        for dtype in ("float32", "bfloat16"):
            for seq in (12, 10):
                before = compare(tiled.gradients(tiling, dtype, 2, seq), tiled.tile_by_tile(tiling, dtype, 2, seq), dtype)
                assert not before.close, (tiling, dtype, seq, str(before))
    fixes.apply(FIX_ID)
    try:
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
    finally:
        fixes.revert(FIX_ID)


def check_batch_of_one_is_right_without_the_fix():
    from fixes.entries.tiled_mlp_batch_size import tiled
    from fixes.harness import assert_close

    _classes()
    for tiling in tiled.TILINGS:
        for seq in (12, 10):
            assert_close(tiled.gradients(tiling, "float32", 1, seq), tiled.gradients(None, "float32", 1, seq),
                         "float32", f"{tiling} batch 1 seq {seq}")


def check_the_fix_trains_like_plain_pytorch_under_zero_0_1_and_3():
    import fixes
    from fixes.entries.tiled_mlp_batch_size import reproduce, tiled

    _classes()
    fixes.apply(FIX_ID)
    try:
        for stage in (0, 1, 3):
            for tiling in tiled.TILINGS:
                found = reproduce.differences(reproduce.sweep_job(zero_stage=stage), tiling, 2, 10)
                assert all(c.close for c in found), (stage, tiling, [str(c) for c in found])
    finally:
        fixes.revert(FIX_ID)


def _drifted_backward(ctx, *grads):
    """A drifted TiledMLP.backward that still has the bug: the incoming gradient read from the flat tensor."""
    (x, ) = ctx.saved_tensors
    incoming_grad = grads[0].view(-1)
    return (None, None, incoming_grad.narrow(0, 0, x.numel()).view_as(x), None, None)


def check_drifted_target_raises_and_patches_nothing():
    tiled_mlp, tiled_compute, _ = _classes()
    before = snapshot(tiled_compute)
    assert_drift_refused(FIX_ID, tiled_mlp, "backward", staticmethod(_drifted_backward))
    assert_same_objects(tiled_compute, before)


_FORWARD = {}


def _drifted_forward(ctx, *args):
    """A drifted SequenceTiledCompute.forward: the original's work plus a new attribute on ctx (the fix's backward
    reads what the forward leaves there, so any change to it is drift)."""
    ctx.drifted = True
    return _FORWARD["original"](ctx, *args)


def check_drifted_forward_is_refused_too():
    tiled_mlp, tiled_compute, _ = _classes()
    _FORWARD["original"] = vars(tiled_compute)["forward"].__func__
    before = snapshot(tiled_mlp)
    assert_drift_refused(FIX_ID, tiled_compute, "forward", staticmethod(_drifted_forward))
    assert_same_objects(tiled_mlp, before)


def check_fixed_release_is_a_noop():
    from fixes.entries.tiled_mlp_batch_size.reproduce import reproduce

    tiled_mlp, tiled_compute, _ = _classes()
    before = snapshot(tiled_compute)
    assert_noop_on_fixed_release(FIX_ID, tiled_mlp)
    assert_same_objects(tiled_compute, before)
    assert reproduce() is False


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
    assert not fixes.get(FIX_ID).applied
    assert reproduce() is False
    try:  # a single run (the trigger grid's) cannot run at all there
        wrong(fixes.get(FIX_ID)._reproduction().sweep_job(), "TiledMLP", 2)
    except CannotTellError as exc:
        assert "no ALST tiled compute" in str(exc), exc
    else:
        raise AssertionError("a TiledMLP run ran on a release without TiledMLP")


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_only_the_two_backward_passes_are_replaced():
    call_in_release(AFFECTED, check_apply_replaces_both_backwards_and_nothing_else)


def test_when_applied_then_gradients_equal_plain_pytorch_for_any_batch_dtype_and_uneven_tiles():
    call_in_release(AFFECTED, check_the_fixed_gradients_equal_plain_pytorch_for_every_batch_and_uneven_tiles)


def test_when_batch_is_one_then_the_affected_release_is_already_right():
    call_in_release(AFFECTED, check_batch_of_one_is_right_without_the_fix)


def test_when_applied_then_training_under_zero_0_1_and_3_matches_plain_pytorch():
    call_in_release(AFFECTED, check_the_fix_trains_like_plain_pytorch_under_zero_0_1_and_3)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_a_forward_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_forward_is_refused_too)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)


def test_when_release_has_no_tiled_compute_then_apply_is_a_noop():
    call_in_release(WITHOUT_TILED_COMPUTE, check_release_without_tiled_compute_is_a_noop_and_nothing_reproduces)
