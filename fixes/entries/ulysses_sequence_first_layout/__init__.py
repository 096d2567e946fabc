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

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.sequence.layer"
_TARGET = Target(_MODULE, "_generate_layout_params")


class UlyssesSequenceFirstLayout(Fix):
    info = FixInfo(
        id="ulysses-sequence-first-layout",
        title=("Ulysses DistributedAttention, sequence-first layout: mis-shaped, scrambled output; "
               "'returned an invalid gradient' in backward"),
        summary=("DeepSpeed-Ulysses sequence parallelism (deepspeed.sequence.layer.DistributedAttention) called "
                 "with batch_dim_idx=1, the sequence-first [s, b, heads, head_dim] layout Megatron-style models "
                 "use, returns its context as [b, P*s, heads/P^2, head_dim] instead of the query's "
                 "[s/P, b, heads, head_dim] (P: the sequence-parallel size). Where the element counts agree no "
                 "error is raised: code that reads the context by its dimensions (a transpose to batch-first, "
                 "indexing a batch row or token) gets other tokens' and sequences' values, and the first "
                 "backward raises. The batch-first layout (batch_dim_idx=0) is correct."),
        symptom="silent wrong result",
        components=("Sequence parallel",),
        error_signatures=(
            "Function _SeqAllToAllBackward returned an invalid gradient at index 0 - got [4, 16, 1, 4] but "
            "expected shape compatible with [8, 2, 4, 4]",
            "AssertionError: Number of heads (1) must be larger than sequence parallel size (2)",
            "DistributedAttention batch_dim_idx=1 output has the wrong shape",
            "Ulysses sequence parallel output scrambled with sequence-first layout [s, b, h, d]",
        ),
        root_cause=("deepspeed/sequence/layer.py, _generate_layout_params: for batch_dim_idx=1 with "
                    "scatter_idx < 2 (the all-to-all that scatters the sequence and gathers the heads: "
                    "DistributedAttention's output, and the q/k/v gradients) it returns "
                    "post_all2all_res_shape = [bs, seq_world_size * global_seq_len, "
                    "num_local_head // seq_world_size, head_dim], the batch-first shape of the opposite "
                    "direction, instead of [global_seq_len // seq_world_size, bs, seq_world_size * "
                    "num_local_head, head_dim]. post_all2all's reshape accepts it whenever the element counts "
                    "agree. PR #6750 introduced the function; before it, post_all2all computed the right shape "
                    "inline."),
        reproduce_release="0.18.9",
        upstream_fixed_in="0.19.7",  # the first release whose layer.py carries PR #8317's change
        upstream_introduced="0.16.3",
        upstream_issues=(7842,),
        upstream_prs=(8317, 6750, 7868),
        upstream_note=("Introduced by PR #6750 (the layout parameters moved into _generate_layout_params, "
                       "0.16.3); fixed by PR #8317 (the sequence-first output shape), whose change is in the 0.19.7 "
                       "release's deepspeed/sequence/layer.py. PR #7868 proposed the "
                       "same shape correction together with padding for uneven sequence lengths."),
    )
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
