"""How ulysses-sequence-first-layout is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe.

``user_script()`` is one rank of a user's Ulysses attention block (what the ``deepspeed`` launcher starts on each
rank): each rank holds its shard of the sequence, wraps a plain local attention
(``torch.nn.functional.scaled_dot_product_attention``) in ``deepspeed.sequence.layer.DistributedAttention`` and
hands the context to the output projection. ``reference()`` is the same attention in one process over the whole
sequence, in plain PyTorch, cut into the rank's shard.
"""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError, RankFailedError

# A tiny attention: global sequence, batch, heads, head dim. The local heads (HEADS / 2 ranks) divide by the 2 ranks
# again: then the affected reshape keeps the element count and the forward pass raises nothing. With 8 heads the
# backward fails on autograd's gradient-shape check; with 4 on DeepSpeed's head-count assertion instead.
SEQ, BATCH, HEADS, HEAD_DIM = 8, 2, 8, 4
# How DistributedAttention is built for each layout (DeepSpeed's docstring and tests): scatter the heads (dim 2),
# gather the sequence (dim 0 for sequence-first, 1 for batch-first).
SCATTER_GATHER = {1: (2, 0), 0: (2, 1)}


def full_qkv(batch_dim_idx: int, dtype: str = "float32") -> tuple[Any, Any, Any]:
    """The whole sequence's q, k, v (seeded, the same on every rank) in the layout ``batch_dim_idx`` names."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    q, k, v = (torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=generator) for _ in range(3))
    if batch_dim_idx == 0:
        q, k, v = (t.transpose(0, 1).contiguous() for t in (q, k, v))
    return tuple(t.to(getattr(torch, dtype)) for t in (q, k, v))


def shard(tensor: Any, batch_dim_idx: int, rank: int, world_size: int) -> Any:
    """``rank``'s contiguous slice of the sequence dimension (1 - ``batch_dim_idx``)."""
    return tensor.chunk(world_size, dim=1 - batch_dim_idx)[rank].contiguous()


class LocalAttention:
    """The user's local attention: ``scaled_dot_product_attention`` over whatever sequence and heads it is given,
    in the layout ``batch_dim_idx`` names (SDPA itself wants [b, h, s, d])."""

    def __init__(self, batch_dim_idx: int) -> None:
        self.batch_dim_idx = batch_dim_idx

    def __call__(self, q: Any, k: Any, v: Any) -> Any:
        import torch.nn.functional as F

        to_bhsd = (1, 2, 0, 3) if self.batch_dim_idx == 1 else (0, 2, 1, 3)
        back = (2, 0, 1, 3) if self.batch_dim_idx == 1 else (0, 2, 1, 3)
        out = F.scaled_dot_product_attention(*(t.permute(*to_bhsd) for t in (q, k, v)))
        return out.permute(*back)


def user_script(batch_dim_idx: int = 1, dtype: str = "float32", backward: bool = False) -> dict[str, Any]:
    """One rank of the user's Ulysses attention block: the model is batch-first, its attention runs in the
    layout ``batch_dim_idx`` names. Returns the batch-first hidden states it hands to the output projection
    ([b, s/P, h*d]), the shape ``DistributedAttention`` returned, and with ``backward`` the gradients of this
    rank's q, k, v shards after a backward pass through a fixed scalar loss."""
    import torch
    import torch.distributed as dist
    from deepspeed.sequence.layer import DistributedAttention

    rank, world_size = dist.get_rank(), dist.get_world_size()
    sequence_group = dist.new_group(list(range(world_size)))  # every rank does sequence parallelism here
    scatter_idx, gather_idx = SCATTER_GATHER[batch_dim_idx]
    attention = DistributedAttention(LocalAttention(batch_dim_idx), sequence_group, scatter_idx=scatter_idx,
                                     gather_idx=gather_idx)

    q, k, v = (shard(t, batch_dim_idx, rank, world_size).requires_grad_(backward)
               for t in full_qkv(batch_dim_idx, dtype))
    context = attention(q, k, v, batch_dim_idx)  # shaped like q: [s/P, b, h, d] sequence-first
    batch_first = context.transpose(0, 1) if batch_dim_idx == 1 else context  # [b, s/P, h, d]
    hidden = batch_first.reshape(BATCH, SEQ // world_size, -1)  # [b, s/P, h*d] for the output projection
    result = {"hidden": hidden.detach(), "context_shape": tuple(context.shape)}
    if backward:
        (hidden.float() * _probe_weights(hidden.shape, rank)).sum().backward()
        result.update(dq=q.grad, dk=k.grad, dv=v.grad)
    return result


def _probe_weights(shape: Any, rank: int) -> Any:
    """Fixed weights for a scalar loss on a rank's hidden states (its shard of the full sequence's weights)."""
    import torch

    return torch.linspace(-1.0, 1.0, int(torch.Size(shape).numel())).reshape(shape) * (rank + 1)


def reference(batch_dim_idx: int, world_size: int = 2, dtype: str = "float32",
              backward: bool = False) -> list[dict[str, Any]]:
    """The same attention in one process over the whole sequence, plain PyTorch, cut into each rank's shard:
    what ``user_script`` must return on each rank."""
    q, k, v = (t.requires_grad_(backward) for t in full_qkv(batch_dim_idx, dtype))
    context = LocalAttention(batch_dim_idx)(q, k, v)
    batch_first = context.transpose(0, 1) if batch_dim_idx == 1 else context
    hidden = batch_first.reshape(BATCH, SEQ, -1)  # [b, s, h*d]
    shards = [shard(hidden.detach(), 0, rank, world_size) for rank in range(world_size)]
    expected_shape = tuple(shard(q, batch_dim_idx, 0, world_size).shape)
    results = [{"hidden": part, "context_shape": expected_shape} for part in shards]
    if backward:
        import torch

        weights = torch.cat([_probe_weights(part.shape, rank) for rank, part in enumerate(shards)], dim=1)
        (hidden.float() * weights).sum().backward()
        for rank, result in enumerate(results):
            result.update({name: shard(t.grad, batch_dim_idx, rank, world_size)
                           for name, t in (("dq", q), ("dk", k), ("dv", v))})
    return results


def differences(ranks: list[dict[str, Any]], expected: list[dict[str, Any]], dtype: str) -> list[Any]:
    """``harness.compare`` of every array each rank returned against the reference, per rank and name."""
    from ...harness import compare

    return [compare(got[name], want[name], dtype, f"rank {rank} {name}")
            for rank, (got, want) in enumerate(zip(ranks, expected)) for name in want if name != "context_shape"]


BACKWARD_ERROR = "returned an invalid gradient"


def reproduce() -> bool:
    """The user's block on two gloo ranks, sequence-first, float32, forward and backward: True if
    ``DistributedAttention`` returns a context not shaped like its query, a rank's hidden states or gradients
    differ from plain PyTorch's full-sequence attention beyond the float32 tolerance, or the backward raises
    the invalid-gradient error."""
    from ...harness import launch

    try:
        ranks = launch(user_script, 2, 1, "float32", True, timeout=120)
    except RankFailedError as exc:
        if BACKWARD_ERROR in exc.message:
            return True
        raise CannotTellError(f"the two-rank attention failed: {exc}") from exc
    expected = reference(1, backward=True)
    return (any(tuple(got["context_shape"]) != want["context_shape"] for got, want in zip(ranks, expected)) or
            not all(comparison.close for comparison in differences(ranks, expected, "float32")))


def wrong_on_two_ranks(batch_dim_idx: int) -> bool:
    """The sweep's check for the layout ``batch_dim_idx`` names: the user's block on two gloo ranks, float32, forward
    and backward; True if the context is not shaped like the query, a rank's hidden states or gradients differ from
    plain PyTorch's full-sequence attention, or the backward raises the invalid-gradient error."""
    from ...harness import launch

    try:
        ranks = launch(user_script, 2, batch_dim_idx, "float32", True, timeout=120)
    except RankFailedError as exc:
        if BACKWARD_ERROR in exc.message:
            return True
        raise CannotTellError(f"the two-rank attention failed: {exc}") from exc
    expected = reference(batch_dim_idx, backward=True)
    return (any(tuple(got["context_shape"]) != want["context_shape"] for got, want in zip(ranks, expected)) or
            not all(comparison.close for comparison in differences(ranks, expected, "float32")))


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's attention block (8 tokens, batch 2, 8 heads) on
    two gloo ranks with the sequence-first layout (``batch_dim_idx=1``), then the batch-first layout
    (``batch_dim_idx=0``, scatter the heads, gather dim 1), forward and backward each, against plain PyTorch."""
    from ...harness import Cell, trigger_job

    return [Cell("DistributedAttention, sequence-first (batch_dim_idx=1)",
                 trigger_job({}, 2, uses=["ulysses-sequence-first"]), lambda: wrong_on_two_ranks(1)),
            Cell("batch-first instead (batch_dim_idx=0)", trigger_job({}, 2), lambda: wrong_on_two_ranks(0),
                 "uses:ulysses-sequence-first")]
