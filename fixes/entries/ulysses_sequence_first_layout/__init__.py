"""Fix for ulysses-sequence-first-layout: wraps ``deepspeed.sequence.layer._generate_layout_params``.

``single_all_to_all`` asks ``_generate_layout_params`` for the reshape/permute plan around each all-to-all and
looks it up in the module at call time, so replacing the module attribute reaches every
``DistributedAttention`` (forward, backward, and the overlapped q/k gradient path, which reuses the same
shape). The wrapper calls the original and, for the one case it gets wrong (sequence-first,
``batch_dim_idx=1``, with ``scatter_idx < 2``: the all-to-all that scatters the sequence and gathers the heads),
replaces the post-all-to-all shape by ``[s // P, b, P * local heads, head_dim]``, which is upstream PR #8317's
change. Every other value it returns is the original's, untouched.

The probe reads the installed function: it asks it for the plan of a sequence-first ``[s, b, h, d]`` input
with ``scatter_idx=0`` on two ranks (only ``input.shape`` is read, so a stand-in with a ``shape`` does) and
checks the result shape is ``[s/2, b, 2*h, d]``. Releases without the function (the shape computed inline in
``post_all2all``) are not affected.
"""
from __future__ import annotations

import functools
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.sequence.layer"
_TARGET = Target(_MODULE, "_generate_layout_params")


class UlyssesSequenceFirstLayout(Fix):
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        module = import_target_module(_MODULE)
        function = getattr(module, "_generate_layout_params", None)
        if function is None:
            return Probe(False, "deepspeed/sequence/layer.py has no _generate_layout_params: post_all2all "
                         "computes the sequence-first output shape inline (before PR #6750)")
        got = list(function(0, 1, 2, _Shaped(_PROBE_SHAPE))[3])
        want = _sequence_first_output_shape(_PROBE_SHAPE, 2)
        if got == want:
            return Probe(False, f"_generate_layout_params(scatter_idx=0, batch_dim_idx=1) reshapes a sequence-first "
                         f"{list(_PROBE_SHAPE)} all-to-all on 2 ranks to {got}, as it should")
        return Probe(True, f"_generate_layout_params(scatter_idx=0, batch_dim_idx=1) reshapes a sequence-first "
                     f"{list(_PROBE_SHAPE)} all-to-all on 2 ranks to {got} instead of {want}")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_sequence_first_shape_fixed)]


# [s, b, local heads, head_dim] of the probe's stand-in input: every dimension different, heads divisible by 2 twice.
_PROBE_SHAPE = (8, 3, 4, 5)


class _Shaped:
    """A stand-in for the all-to-all input: ``_generate_layout_params`` reads only ``input.shape``."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _sequence_first_output_shape(shape: Any, seq_world_size: int) -> list[int]:
    """Where the sequence-first all-to-all that scatters the sequence and gathers the heads must land:
    [s / P, b, P * local heads, head_dim]."""
    global_seq_len, bs, num_local_head, head_dim = shape
    return [global_seq_len // seq_world_size, bs, seq_world_size * num_local_head, head_dim]


def _sequence_first_shape_fixed(original: Any) -> Any:
    @functools.wraps(original)
    def _generate_layout_params(scatter_idx, batch_dim_idx, seq_world_size, input):
        pre_permute, pre_shape, post_permute, post_shape = original(scatter_idx, batch_dim_idx, seq_world_size,
                                                                    input)
        if batch_dim_idx != 0 and scatter_idx < 2:
            # The all-to-all returns [P, s/P, b, local heads, d]; post_permute (1, 2, 0, 3, 4) makes it
            # [s/P, b, P, local heads, d]: merge the last heads, keep the sequence-first order.
            post_shape = _sequence_first_output_shape(input.shape, seq_world_size)
        return pre_permute, pre_shape, post_permute, post_shape

    return _generate_layout_params


FIX = UlyssesSequenceFirstLayout()
