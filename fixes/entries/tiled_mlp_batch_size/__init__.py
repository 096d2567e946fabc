"""Fix for tiled-mlp-batch-size: replaces ``TiledMLP.backward`` and ``SequenceTiledCompute.backward``
(``deepspeed/runtime/sequence_parallel/ulysses_sp.py``) with the backward passes of the first release that has
upstream's fix, PR #7412 as PR #7422 completed it (both are in that release):

* ``TiledMLP.backward`` flattens ``[batch, seq, hidden]`` to ``[batch * seq, hidden]`` (the MLP acts on every token
  alone) and recomputes it in ``shards`` tiles of that flat dimension, so each tile's incoming gradient and its
  slot in the input's gradient are the rows of the same tokens. PR #7412 narrowed the sequence dimension instead;
  PR #7422 moved to the flat dimension (no strided gradient slots) and sized the last, shorter tile by itself
  (PR #7412 alone narrowed past the end where the sequence does not divide by ``shards``). Flattened with
  ``reshape`` (upstream's later form) rather than ``view``, so a non-contiguous input or gradient is accepted.
* ``SequenceTiledCompute.backward`` keeps its sequence tiles and narrows dimension 1 (the sequence) of the
  incoming gradient and of the input's gradient, the last tile sized by itself. With batch 1 a tile's gradient
  slot is a view the tile's backward fills in place (as before); with batch > 1 the tile's gradient is copied
  into its slot after its backward (PR #7422's way; upstream leaves the slot unwritten, hence uninitialised,
  where the tile got no gradient: here it is zeroed, as it is with batch 1).

Both replacements keep every other step of the originals (the ``ds_grad_is_ready`` flags that hold ZeRO's
gradient reduction back until the last tile, the returned gradient tuple). ``autograd.Function`` looks its
``backward`` up on the class when the backward runs, so the fix also reaches outputs computed before it was
applied. ``TiledLoss.backward`` (an older loss path the same PR touched) is left alone: its forward already raises
for a batch of more than one sequence (``all(...)`` of a 2-D tensor), and PR #7412's change to it breaks its
last, shorter shard at batch 1.

The probe runs both functions once on a tiny linear map over a ``[2, 4, 3]`` input in two tiles, under
``torch.enable_grad()``, and compares the input's and the weight's gradients with plain autograd's; it touches
nothing else. Releases without the module (before ALST) or without the classes are not affected.
"""
from __future__ import annotations

from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"
_TILED_MLP = Target(_MODULE, "TiledMLP.backward")
_TILED_COMPUTE = Target(_MODULE, "SequenceTiledCompute.backward")
# The replacements read what these forwards put on ``ctx``: a change to them is drift too.
_TILED_MLP_FORWARD = Target(_MODULE, "TiledMLP.forward")
_TILED_COMPUTE_FORWARD = Target(_MODULE, "SequenceTiledCompute.forward")


class TiledMlpBatchSize(Fix):
    targets = (_TILED_MLP, _TILED_COMPUTE, _TILED_MLP_FORWARD, _TILED_COMPUTE_FORWARD)

    def read_code(self) -> Probe:
        import importlib
        import importlib.util

        if (importlib.util.find_spec("deepspeed.runtime.sequence_parallel") is None
                or importlib.util.find_spec(_MODULE) is None):
            return Probe(False, f"this DeepSpeed has no {_MODULE} (no ALST tiled compute: TiledMLP, "
                                "sequence_tiled_compute)")
        module = importlib.import_module(_MODULE)
        missing = [name for name in ("TiledMLP", "SequenceTiledCompute") if not hasattr(module, name)]
        if missing:
            return Probe(False, f"{_MODULE} has no {' or '.join(missing)}")
        wrong = [name for name, check in (("TiledMLP", _tiled_mlp_wrong), ("SequenceTiledCompute",
                                                                            _tiled_compute_wrong))
                 if check(module)]
        if wrong:
            return Probe(True, f"{' and '.join(f'{name}.backward' for name in wrong)} give a [2, 4, 3] input "
                               "(batch 2, two sequence tiles) other gradients than plain autograd")
        return Probe(False, "TiledMLP.backward and SequenceTiledCompute.backward give a [2, 4, 3] input "
                            "(batch 2, two sequence tiles) the gradients plain autograd gives")

    def patches(self) -> list[AttributePatch]:
        return [_TILED_MLP.replace(staticmethod(tiled_mlp_backward)),
                _TILED_COMPUTE.replace(staticmethod(sequence_tiled_compute_backward))]


# ---- the probe: one tiny backward through each function -------------------------------------------------------

def _probe_inputs() -> tuple[Any, Any, Any]:
    """A [batch 2, seq 4, hidden 3] input, a 3x3 weight and an incoming gradient: fixed values, every element
    different (no random state is touched)."""
    import torch

    x = (torch.arange(24, dtype=torch.float64).reshape(2, 4, 3) / 7.0).sin()
    weight = (torch.arange(9, dtype=torch.float64).reshape(3, 3) / 3.0).cos()
    incoming = (torch.arange(24, dtype=torch.float64).reshape(2, 4, 3) / 5.0).cos()
    return x, weight, incoming


def _probe_fn(self: Any, x: Any) -> Any:
    return x @ self.weight


class _Holder:
    """What the tiled functions pass to ``fn`` as ``self``: here only the weight."""

    def __init__(self, weight: Any) -> None:
        self.weight = weight


def _gradients(run: Any) -> tuple[Any, Any]:
    import torch

    x, weight, incoming = _probe_inputs()
    x.requires_grad_()
    weight.requires_grad_()
    with torch.enable_grad():
        run(_Holder(weight), x).backward(incoming)
    return x.grad, weight.grad


def _differs(run: Any) -> bool:
    import torch

    want = _gradients(lambda holder, x: _probe_fn(holder, x))
    got = _gradients(run)
    return any(g is None or not torch.allclose(g, w, rtol=1e-9, atol=1e-12) for g, w in zip(got, want))


def _tiled_mlp_wrong(module: Any) -> bool:
    return _differs(lambda holder, x: module.TiledMLP.apply(_probe_fn, holder, x, 2, [holder.weight]))


def _tiled_compute_wrong(module: Any) -> bool:
    return _differs(lambda holder, x: module.sequence_tiled_compute(
        _probe_fn, x.shape[1], 2, {"x": x}, {"self": holder}, "x", [holder.weight],
        output_unshard_dimension=1, output_reduction=None))


# ---- the replacements: the backward passes of the fixed release -----------------------------------------------

def _hold_back_reduction(compute_params: Any, shard: int, shards: int) -> None:
    """Tell DeepSpeed ZeRO not to reduce the weights' gradients until the last shard (the originals' flags)."""
    if compute_params is not None:
        for param in compute_params:
            param.ds_grad_is_ready = shard + 1 >= shards


def tiled_mlp_backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
    """``TiledMLP.backward`` as upstream fixed it: the tiles are rows of the flattened ``[batch * seq, hidden]``
    input, and each tile's incoming gradient and input-gradient slot are the same rows."""
    import torch

    fn = ctx.fn
    (x, ) = ctx.saved_tensors
    self = ctx.self
    shards = ctx.shards
    compute_params = ctx.compute_params

    x_requires_grad = x.requires_grad
    x = x.detach()
    x.requires_grad_(x_requires_grad)  # detach() unsets it

    hidden_size = x.shape[-1]
    x_shape = x.shape
    # every token alone through the MLP: tile the flattened tokens, so a tile's rows are contiguous
    x = x.reshape(-1, hidden_size)
    incoming_grad = grads[0].reshape(-1, hidden_size)
    x_grad = torch.zeros_like(x)
    x_shards = list(torch.chunk(x, chunks=shards, dim=0))
    for i, x_shard in enumerate(x_shards):
        _hold_back_reduction(compute_params, i, shards)
        x_shard.requires_grad_(x_requires_grad)
        # the last tile is shorter where the rows do not divide by shards
        shard_step = x_shards[i].shape[0]
        shard_offset = i * x_shards[0].shape[0]
        x_shard.grad = x_grad.narrow(0, shard_offset, shard_step).view_as(x_shard)
        incoming_grad_shard = incoming_grad.narrow(0, shard_offset, shard_step).view_as(x_shard)
        with torch.enable_grad():
            output = fn(self, x_shard)
        torch.autograd.backward(output, incoming_grad_shard)
    return (None, None, x_grad.view(x_shape), None, None)


def sequence_tiled_compute_backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
    """``SequenceTiledCompute.backward`` as upstream fixed it: each tile's incoming gradient and input-gradient
    slot are its own sequence positions (dimension 1), in every sequence of the batch."""
    import torch

    fn = ctx.fn
    shards = ctx.shards
    kwargs_to_shard = ctx.kwargs_to_shard
    kwargs_to_pass = ctx.kwargs_to_pass
    key = ctx.grad_requiring_tensor_key
    compute_params = ctx.compute_params
    output_unshard_dimension = ctx.output_unshard_dimension

    tensor = kwargs_to_shard[key]
    requires_grad = tensor.requires_grad
    tensor = tensor.detach()
    tensor.requires_grad_(requires_grad)  # detach() unsets it
    incoming_grad = grads[0]
    batch_of_one = tensor.shape[0] == 1
    tensor_grad = torch.zeros_like(tensor)

    kwargs_shards = {k: list(torch.chunk(v, chunks=shards, dim=1)) for k, v in kwargs_to_shard.items()}
    for i in range(shards):
        _hold_back_reduction(compute_params, i, shards)
        kwargs_shard = {k: v[i] for k, v in kwargs_shards.items()}
        tensor_shard = kwargs_shard[key]
        tensor_shard.requires_grad_(requires_grad)
        # the last tile is shorter where the sequence does not divide by shards
        shard_step = kwargs_shards[key][i].shape[1]
        shard_offset = i * kwargs_shards[key][0].shape[1]
        slot = tensor_grad.narrow(1, shard_offset, shard_step)
        if batch_of_one:  # the slot is laid out like the tile: the tile's backward fills it in place
            tensor_shard.grad = slot.view_as(tensor_shard)
        with torch.enable_grad():
            output = fn(**kwargs_shard, **kwargs_to_pass)
        if output_unshard_dimension == 0:  # the loss use-case
            torch.autograd.backward(output, incoming_grad)
        else:
            torch.autograd.backward(output, incoming_grad.narrow(1, shard_offset, shard_step).view_as(tensor_shard))
        if not batch_of_one and tensor_shard.grad is not None:  # a strided slot: copy the tile's gradient in
            slot.copy_(tensor_shard.grad)

    grad_outputs = [None] * 9  # the positional arguments before *args
    arg_outputs = [None] * ctx.total_args
    arg_outputs[ctx.grad_requiring_tensor_key_index] = tensor_grad
    return tuple(grad_outputs + arg_outputs)


FIX = TiledMlpBatchSize()
