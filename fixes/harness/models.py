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


class SeededLinear(torch.nn.Linear):
    """``torch.nn.Linear`` whose initial values always come from the CPU generator.

    ``deepspeed.zero.Init`` makes a module's parameters on the accelerator, so on CUDA ``Linear``'s own
    ``reset_parameters`` would draw them from the CUDA generator, and the model would start from other weights
    than the plain-PyTorch reference built on CPU (seen on an H200: 0.66 apart after three steps). Here parameters made
    off the CPU get the values ``Linear`` draws for CPU tensors of their dtype, drawn the same way from the same
    generator state; parameters made on the CPU are ``Linear``'s own, unchanged. It prints as ``Linear``."""

    def reset_parameters(self) -> None:
        if self.weight.device.type == "cpu":
            super().reset_parameters()
            return
        weight, bias = cpu_initial_values(self.weight, self.bias)
        with torch.no_grad():
            self.weight.copy_(weight)
            if self.bias is not None:
                self.bias.copy_(bias)

    def _get_name(self) -> str:
        return "Linear"


@dataclass
class _LinearValues:
    weight: torch.Tensor
    bias: torch.Tensor | None


def cpu_initial_values(weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What ``Linear.reset_parameters`` draws for CPU tensors shaped and typed as ``weight`` and ``bias``, from
    the CPU generator in its current state (which it advances as that call would)."""
    on_cpu = _LinearValues(torch.empty(weight.shape, dtype=weight.dtype, device="cpu"),
                           None if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device="cpu"))
    torch.nn.Linear.reset_parameters(on_cpu)  # type: ignore[arg-type] - it reads weight and bias only
    return on_cpu.weight, on_cpu.bias


class TinyMLP(torch.nn.Module):
    def __init__(self, spec: ModelSpec = ModelSpec()) -> None:
        super().__init__()
        # Seeded locally so the same spec gives the same weights wherever it is built, also
        # inside deepspeed.zero.Init and on CUDA (SeededLinear), without disturbing the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(spec.seed)
            self.fc1 = SeededLinear(spec.in_features, spec.hidden)
            self.act = torch.nn.Tanh()
            self.fc2 = SeededLinear(spec.hidden, spec.out_features)

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
