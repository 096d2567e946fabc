"""The classification of direct-backward attempts (no DeepSpeed needed)."""
import numpy as np
import pytest

from fixes.entries.engine_tensor_backward.reproduce import Attempt, BackwardModes
from fixes.harness import Job, TrainResult


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
