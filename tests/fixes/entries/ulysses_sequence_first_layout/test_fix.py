"""ulysses-sequence-first-layout beyond the contract and the notebook (0.18.9, both layouts on two ranks vs plain
PyTorch): every other layout branch returns what the original returns."""
from types import SimpleNamespace

from tests.helpers import call_in_release


def check_the_fix_changes_only_the_sequence_first_gather_heads_shape():
    import fixes
    from fixes.entries.ulysses_sequence_first_layout import _MODULE
    from fixes.harness import setup
    from fixes.patching import import_target_module

    setup()
    owner = import_target_module(_MODULE)
    inputs = [(scatter_idx, batch_dim_idx, world_size, SimpleNamespace(shape=shape))
              for scatter_idx in (0, 1, 2) for batch_dim_idx in (0, 1) for world_size in (2, 4)
              for shape in ((16, 3, 8, 5), (8, 2, 16, 4))]
    before = [owner._generate_layout_params(*args) for args in inputs]
    fixes.apply("ulysses-sequence-first-layout")
    after = [owner._generate_layout_params(*args) for args in inputs]
    changed = [args[:3] for args, old, new in zip(inputs, before, after) if old != new]
    assert sorted(set(changed)) == [(s, 1, w) for s in (0, 1) for w in (2, 4)], changed
    for (scatter_idx, batch_dim_idx, world_size, shaped), old, new in zip(inputs, before, after):
        assert new[:3] == old[:3], (scatter_idx, batch_dim_idx, world_size)  # the permutes and the pre-all-to-all shape
        if batch_dim_idx == 1 and scatter_idx < 2:
            s, b, h, d = shaped.shape
            assert list(new[3]) == [s // world_size, b, world_size * h, d], (scatter_idx, world_size, new[3])


def test_when_applied_then_only_the_sequence_first_gather_heads_shape_changes():
    call_in_release("0.18.9", check_the_fix_changes_only_the_sequence_first_gather_heads_shape)
