"""Direct-backward jobs and their classification (no DeepSpeed needed)."""
import numpy as np
import pytest
import torch

from fixes.entries.engine_tensor_backward.reproduce import Attempt, BackwardModes
from fixes.harness import Job, TinyMLP, TrainResult
from fixes.harness.training import _backward


class _PlainEngine(torch.nn.Module):
    """Stands in for a DeepSpeed engine: forward is the model, backward is loss.backward()."""

    def __init__(self) -> None:
        super().__init__()
        self.model = TinyMLP()

    def forward(self, x):
        return self.model(x)

    def backward(self, loss):
        loss.backward()


def _grads(mode: str) -> list[torch.Tensor]:
    engine = _PlainEngine()
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 4)
    _backward(engine, mode, engine(x), y)
    return [p.grad for p in engine.parameters()]


def test_when_backward_mode_is_unknown_then_job_is_refused():
    with pytest.raises(ValueError, match="unknown backward"):
        Job(backward="autograd")


@pytest.mark.parametrize("mode", ["tensor", "tensor-grad"])
def test_when_backward_is_direct_then_it_computes_the_same_gradients_as_engine_backward(mode):
    for direct, via_engine in zip(_grads(mode), _grads("engine")):
        torch.testing.assert_close(direct, via_engine)


def _trained(value: float) -> Attempt:
    return Attempt(Job(), TrainResult({"w": np.full(3, value, dtype=np.float32)}, [], [1.0]))


def _modes(direct: Attempt) -> BackwardModes:
    return BackwardModes("row", Job(), _trained(1.0), {"tensor": direct})


def test_when_direct_backward_trains_differently_then_the_outcome_shows_the_bug():
    assert _modes(_trained(1.0)).outcome("tensor").text == "identical"
    outcome = _modes(_trained(1.5)).outcome("tensor")
    assert outcome.kind == "differs" and outcome.shows_bug and outcome.max_abs_diff == 0.5


def test_when_direct_backward_crashes_in_step_then_it_is_a_crash_not_a_refusal():
    crash = Attempt(Job(), error="KeyError: 0", call="engine.step()", raised_in="stage_1_and_2.py step")
    outcome = _modes(crash).outcome("tensor")
    assert outcome.kind == "crash" and outcome.shows_bug and outcome.text == "KeyError: 0 at engine.step()"


def test_when_direct_backward_is_refused_at_the_call_then_it_is_not_the_bug():
    refused = Attempt(Job(), error="RuntimeError: Direct calls to tensor.backward() are not supported in this "
                      "configuration. Please use engine.backward(loss) instead.", call="loss.backward()")
    outcome = _modes(refused).outcome("tensor")
    assert outcome.kind == "refused" and not outcome.shows_bug
