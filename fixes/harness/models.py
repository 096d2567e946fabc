"""Tiny deterministic models and data: every notebook builds its own, no downloads."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelSpec:
    """A two-layer MLP ``Linear(in, hidden) → Tanh → Linear(hidden, out)`` with seeded weights."""

    in_features: int = 8
    hidden: int = 16
    out_features: int = 4
    seed: int = 0


# The model of the benchmark jobs (``python -m ci.bench``, :func:`fixes.harness.training.bench_job`): big
# enough that a training step takes at least 50 ms on a 2-core CPU (a step does six 64x1024 by 1024x2048
# matmuls; the measured step times are on the Performance page), so what a fix adds to a step is not lost in
# DeepSpeed's per-step overhead.
BENCH_MODEL = ModelSpec(in_features=1024, hidden=2048, out_features=1024)
BENCH_MICRO_BATCH = 64


class TinyMLP(torch.nn.Module):
    def __init__(self, spec: ModelSpec = ModelSpec()) -> None:
        super().__init__()
        # Seeded locally so the same spec gives the same weights wherever it is built, also
        # inside deepspeed.zero.Init, without disturbing the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.fc1 = torch.nn.Linear(spec.in_features, spec.hidden)
            self.act = torch.nn.Tanh()
            self.fc2 = torch.nn.Linear(spec.hidden, spec.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@dataclass(frozen=True)
class Batches:
    """Inputs and targets shaped ``[steps, micro_steps, world_size, micro_batch, features]``."""

    inputs: torch.Tensor
    targets: torch.Tensor

    def micro(self, step: int, micro_step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[step, micro_step, rank], self.targets[step, micro_step, rank]

    @property
    def shape(self) -> tuple[int, int, int]:
        steps, micro_steps, world_size = self.inputs.shape[:3]
        return steps, micro_steps, world_size


def make_batches(spec: ModelSpec, steps: int, micro_steps: int = 1, world_size: int = 1, micro_batch: int = 4,
                 seed: int = 1) -> Batches:
    generator = torch.Generator().manual_seed(seed)
    shape = (steps, micro_steps, world_size, micro_batch)
    inputs = torch.randn(*shape, spec.in_features, generator=generator)
    targets = torch.randn(*shape, spec.out_features, generator=generator)
    return Batches(inputs, targets)


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output.float() - target.float())**2).mean()
