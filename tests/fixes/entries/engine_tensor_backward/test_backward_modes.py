"""Direct-backward jobs and their classification (no DeepSpeed needed)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from fixes.entries.engine_tensor_backward.reproduce import Attempt, BackwardModes
from fixes.harness import Job, TinyMLP, TrainResult
from fixes.harness.training import _backward


def _grads(mode: str) -> list[torch.Tensor]:
    """TinyMLP's gradients after one backward in ``mode``, where ``engine.backward`` is plain ``loss.backward()``."""
    model, engine = TinyMLP(), SimpleNamespace(backward=lambda loss: loss.backward())
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 4)
    _backward(engine, mode, model(x), y)
    return [p.grad for p in model.parameters()]


def test_when_backward_mode_is_unknown_then_job_is_refused():
    with pytest.raises(ValueError, match="unknown backward"):
        Job(backward="autograd")


@pytest.mark.parametrize("mode", ["tensor", "tensor-grad"])
def test_when_backward_is_direct_then_it_computes_the_same_gradients_as_engine_backward(mode):
    for direct, via_engine in zip(_grads(mode), _grads("engine")):
        torch.testing.assert_close(direct, via_engine)


def _trained(value: float) -> Attempt:
    return Attempt(Job(), TrainResult({"w": np.full(3, value, dtype=np.float32)}, [], [1.0]))


REFUSED = ("RuntimeError: Direct calls to tensor.backward() are not supported in this configuration. Please use "
           "engine.backward(loss) instead.")


@pytest.mark.parametrize(("direct", "kind", "shows_bug", "text"), [
    (_trained(1.0), "same", False, "identical"),
    (_trained(1.5), "differs", True, "Δ 5.0e-01 (silently wrong)"),
    (Attempt(Job(), error="KeyError: 0", call="engine.step()", raised_in="stage_1_and_2.py step"), "crash", True,
     "KeyError: 0 at engine.step()"),  # a crash in step, not a refusal
    (Attempt(Job(), error=REFUSED, call="loss.backward()"), "refused", False, None),  # refused at the call: not the bug
])
def test_when_a_direct_backward_is_classified_then_only_a_difference_or_a_crash_shows_the_bug(direct, kind, shows_bug,
                                                                                            text):
    outcome = BackwardModes("row", Job(), _trained(1.0), {"tensor": direct}).outcome("tensor")
    assert (outcome.kind, outcome.shows_bug) == (kind, shows_bug)
    assert text is None or outcome.text == text
    assert kind != "differs" or outcome.max_abs_diff == 0.5
