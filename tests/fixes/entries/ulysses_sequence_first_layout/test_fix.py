"""ulysses-sequence-first-layout on an affected release, on the newest (fixed) one and on the last release before
the regression, in child processes."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.18.9"
FIX_ID = "ulysses-sequence-first-layout"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.ulysses_sequence_first_layout import _MODULE
    from fixes.patching import import_target_module

    return import_target_module(_MODULE)


def _generate_layout_params(scatter_idx, batch_dim_idx, seq_world_size, input, num_kv_heads=None):
    """A drifted _generate_layout_params (a new keyword) that still has the bug: the sequence-first
    gather-heads shape is the batch-first one."""
    if batch_dim_idx == 1 and scatter_idx < 2:
        global_seq_len, bs, num_local_head, head_dim = input.shape
        return (None, [seq_world_size, global_seq_len // seq_world_size, bs, num_local_head, head_dim],
                (1, 2, 0, 3, 4), [bs, seq_world_size * global_seq_len, num_local_head // seq_world_size, head_dim])
    raise NotImplementedError("only the affected branch is drifted here")


def check_the_fix_changes_only_the_sequence_first_gather_heads_shape():
    import fixes

    owner = _owner()
    original = owner._generate_layout_params
    inputs = [(scatter_idx, batch_dim_idx, world_size, _Shaped(shape))
              for scatter_idx in (0, 1, 2) for batch_dim_idx in (0, 1) for world_size in (2, 4)
              for shape in ((16, 3, 8, 5), (8, 2, 16, 4))]
    before = [original(*args) for args in inputs]
    fixes.apply(FIX_ID)
    after = [owner._generate_layout_params(*args) for args in inputs]
    fixes.revert(FIX_ID)
    changed = [args[:3] for args, old, new in zip(inputs, before, after) if old != new]
    assert sorted(set(changed)) == [(s, 1, w) for s in (0, 1) for w in (2, 4)], changed
    for args, old, new in zip(inputs, before, after):
        assert new[:3] == old[:3], args  # the permutes and the pre-all-to-all shape are the original's
        if args[1] == 1 and args[0] < 2:
            s, b, h, d = args[3].shape
            world_size = args[2]
            assert list(new[3]) == [s // world_size, b, world_size * h, d], (args[:3], new[3])


class _Shaped:
    def __init__(self, shape):
        self.shape = shape


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.ulysses_sequence_first_layout import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, _generate_layout_params)


def test_when_applied_then_only_the_sequence_first_gather_heads_shape_changes():
    call_in_release(AFFECTED, check_the_fix_changes_only_the_sequence_first_gather_heads_shape)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)
