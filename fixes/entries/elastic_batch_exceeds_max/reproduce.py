"""How elastic-batch-exceeds-max is reproduced: the fast check the release sweep runs (``reproduce()``: True where
the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe.

Also what the notebook shares with it: :data:`ELASTICITY` (the user's ``"elasticity"`` block) and :func:`config`
(the whole DeepSpeed config), :func:`samples` (the training data, one stream of samples whatever the batch size),
:func:`train_reference` (plain PyTorch at a given batch size) and :data:`ALLOWED_BATCH`.

The job trains a ``TinyMLP`` with SGD on one process. Elasticity splits the train batch size it picks into the
largest of ``micro_batch_sizes`` that divides it per rank and gradient accumulation steps; the script feeds the
engine micro-batches of that size from one sample stream, so a run at train batch size ``B`` is plain PyTorch's
SGD on consecutive batches of ``B`` samples of the same stream (the micro-batch losses are averaged by the
engine's gradient accumulation, as the mean over ``B`` samples is).
"""
from __future__ import annotations

import copy
import math
from functools import reduce
from typing import Any

MAX_BATCH = 100  # the user's "max_train_batch_size"
MICRO_BATCHES = [8, 10, 12]  # the user's "micro_batch_sizes": their least common multiple is 120
ELASTICITY = {"enabled": True, "max_train_batch_size": MAX_BATCH, "micro_batch_sizes": MICRO_BATCHES,
              "min_gpus": 1, "max_gpus": 64, "min_time": 20, "version": 0.1}
# The train batch size elasticity documents for this block: the largest batch "less than the max_acceptable batch
# size" of each base scaled by a highly composite number -- 8 x 12 = 96, 10 x 6 = 60, 12 x 6 = 72 (the LCM 120 is
# above the cap and cannot be scaled under it) -- and among those the one with the most valid GPU counts: 96
# (1, 2, 3, 4, 6, 8 and 12 GPUs). On one process: micro-batches of 12, 8 gradient accumulation steps.
ALLOWED_BATCH = 96
LR = 0.1
SAMPLE_SEED = 1


def lcm(values: list[int]) -> int:
    return reduce(lambda a, b: a * b // math.gcd(a, b), values)


def config(elasticity: dict[str, Any] | None = None, zero_stage: int = 0) -> dict[str, Any]:
    """The user's DeepSpeed config: the elasticity block, no batch size of its own (elasticity computes it), and
    what the Fixbook's harness pins in every job (defaults that moved between releases, precision, logging)."""
    from ...harness.training import pinned_config

    import torch

    return {"elasticity": dict(elasticity or ELASTICITY), "zero_optimization": {"stage": zero_stage},
            "zero_force_ds_cpu_optimizer": False, **pinned_config(torch.float32)}


def samples(count: int) -> tuple[Any, Any]:
    """The first ``count`` samples (inputs, targets) of the training stream: the same prefix for every ``count``."""
    import torch

    from ...harness import ModelSpec

    spec = ModelSpec()
    inputs = torch.randn(count, spec.in_features, generator=torch.Generator().manual_seed(SAMPLE_SEED))
    targets = torch.randn(count, spec.out_features, generator=torch.Generator().manual_seed(SAMPLE_SEED + 1))
    return inputs, targets


def train_reference(batch: int, steps: int) -> dict[str, Any]:
    """Plain PyTorch, no DeepSpeed: the same ``TinyMLP`` and SGD, ``steps`` steps on consecutive batches of
    ``batch`` samples of the stream, the loss the mean over the batch. Returns the weights (fp32 numpy)."""
    import torch

    from ...harness import TinyMLP, device, mse

    place = device()  # where the engine runs, so that both sides round alike (a no-op on CPU)
    model = TinyMLP().to(place)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = samples(steps * batch)
    for step in range(steps):
        x, y = inputs[step * batch:(step + 1) * batch], targets[step * batch:(step + 1) * batch]
        loss = mse(model(x.to(place)), y.to(place))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: p.detach().float().cpu().numpy().copy() for name, p in model.named_parameters()}


def engine_for(ds_config: dict[str, Any]) -> Any:
    """``deepspeed.initialize`` on the user's model and optimizer (after ``harness.setup()``)."""
    import deepspeed
    import torch

    from ...harness import TinyMLP

    model = TinyMLP()
    # a copy: DeepSpeed writes the batch sizes elasticity chose into the dict it is given, and refuses a dict
    # holding them next to an elasticity block the next time
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                           config=copy.deepcopy(ds_config))
    return engine


REMOVED = "Elastic training has been removed"  # the config's answer to an "elasticity" block where it is gone


def chosen_batch(ds_config: dict[str, Any]) -> int | None:
    """The train batch size the engine runs ``ds_config`` with; None where DeepSpeed refuses the elasticity block
    because it has no elastic training any more."""
    try:
        engine = engine_for(ds_config)
    except Exception as exc:  # noqa: BLE001 - only the removal is an answer; anything else propagates
        if REMOVED in str(exc):
            return None
        raise
    return int(engine.train_batch_size())


def exceeds(ds_config: dict[str, Any]) -> bool:
    """Whether the engine's train batch size is above the config's max_train_batch_size."""
    batch = chosen_batch(ds_config)
    return batch is not None and batch > ds_config["elasticity"]["max_train_batch_size"]


def reproduce() -> bool:
    """The user's config through ``deepspeed.initialize``: True if the engine trains with a batch above
    max_train_batch_size (120 > 100), False if within it, or if the release refuses the elasticity block (it has
    no elastic training, so it picks no batch size)."""
    return exceeds(config())


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell through ``deepspeed.initialize`` on one process: is
    the train batch size above max_train_batch_size? The user's block (elasticity v0.1), the same with version 0.2
    (DeepSpeed's default, which calls v0.1's heuristic per node), the same under ZeRO-2, and upstream's
    ``test_proper_mbsz`` block (max 32, micro batch sizes [1, 2, 3, 7]: the LCM 42 comes back). Flipped: the block
    turned off with the batch of 96 set directly (what DeepSpeed's own removal message tells users to do), and the
    documentation's block (max 2000, micro batch sizes [2, 4, 6]: LCM 12, within the cap)."""
    from ...harness import Cell, trigger_job

    def cell(label: str, ds_config: dict[str, Any], flips: str = "") -> Cell:
        return Cell(label, trigger_job(ds_config), lambda: exceeds(ds_config), flips)

    upstream = {**ELASTICITY, "max_train_batch_size": 32, "micro_batch_sizes": [1, 2, 3, 7]}
    documented = {**ELASTICITY, "max_train_batch_size": 2000, "micro_batch_sizes": [2, 4, 6]}
    off = {**config({**ELASTICITY, "enabled": False}), "train_batch_size": ALLOWED_BATCH,
           "train_micro_batch_size_per_gpu": 12}
    return [cell("elasticity v0.1, max_train_batch_size 100, micro_batch_sizes [8, 10, 12]", config()),
            cell("the same with version 0.2 (the default)", config({**ELASTICITY, "version": 0.2})),
            cell("the same under ZeRO-2", config(zero_stage=2)),
            cell("max_train_batch_size 32, micro_batch_sizes [1, 2, 3, 7] (upstream's test)", config(upstream)),
            cell("elasticity off, train_batch_size 96 set directly", off, "elasticity"),
            cell("max_train_batch_size 2000, micro_batch_sizes [2, 4, 6] (the documentation's block)",
                 config(documented), "elasticity")]
