"""How zero3-hooks-attribute-delegating-modules is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix applied. Imported by the sweep, the tests and the
notebook, never by the fix or its probe. The models and runs are in ``delegation.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """ZeRO-3 on one rank, fp32, two steps, every parameter released after use: first TinyMLP with its output
    layer in PEFT's ``ModulesToSaveWrapper``, then with it in a delegating wrapper that has a parameter of its
    own (where ZeRO-3 makes its hook classes lazily, only that one fails). True if a run raises this bug's error
    (the missing ``ds_grads_remaining`` in forward, or the released parameter in backward) or trains differently
    from plain PyTorch (beyond ``TOLERANCES``); CannotTellError if a run fails with another error."""
    from .delegation import MODELS, job, run

    for model_name in MODELS:
        outcome = run(job(), model_name)
        if outcome.error is not None:
            if outcome.bug_error:
                return True
            raise CannotTellError(f"{model_name}: the run failed with another error: {outcome.error_line[:300]}")
        if not outcome.matches:
            return True
    return False


def bench_job() -> Any:
    """The bench job (``python -m ci.bench``): the fix answers every ``hasattr`` of ZeRO-3's module hooks, so it
    is on the training path of every ZeRO-3 model."""
    from ... import harness

    return harness.bench_job(zero_stage=3)
