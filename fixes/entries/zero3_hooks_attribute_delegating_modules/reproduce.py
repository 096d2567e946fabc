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
    from .delegation import job

    return bug_shows(job())


def bug_shows(job: Any, forwarding: bool = True) -> bool:
    """:func:`reproduce`'s check of ``job``: each model of :data:`~.delegation.MODELS` on one launched rank, next
    to its plain-PyTorch reference. ``forwarding=False``: the same models with the wrappers' ``__getattr__``
    replaced by ``nn.Module``'s own (:func:`without_forwarding_script`), the wrappers delegating nothing."""
    from .delegation import MODELS, run

    for model_name in MODELS:
        outcome = run(job, model_name) if forwarding else run_without_forwarding(job, model_name)
        if outcome.error is not None:
            if outcome.bug_error:
                return True
            raise CannotTellError(f"{model_name}: the run failed with another error: {outcome.error_line[:300]}")
        if not outcome.matches:
            return True
    return False


WITHOUT_FORWARDING = ", its __getattr__ nn.Module's own"


def without_forwarding_script(job: Any, model_name: str) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): :func:`~.delegation.user_script` on ``model_name``'s model
    with its wrapper's class given ``nn.Module.__getattr__`` back: the same modules, parameters and forward, but
    an attribute the wrapper lacks raises AttributeError instead of being read from the wrapped module."""
    import torch

    from . import delegation

    build = delegation.MODELS[model_name]

    def plain_getattr(spec: Any) -> torch.nn.Module:
        model = build(spec)
        kind = type(model.fc2)
        model.fc2.__class__ = type(kind.__name__, (kind,), {"__getattr__": torch.nn.Module.__getattr__})
        return model

    delegation.MODELS[model_name + WITHOUT_FORWARDING] = plain_getattr  # in this rank's process only
    return delegation.user_script(job, model_name + WITHOUT_FORWARDING)


def run_without_forwarding(job: Any, model_name: str, timeout: float = 180.0) -> Any:
    """:func:`~.delegation.run` with :func:`without_forwarding_script` as the rank: an :class:`~.delegation.Outcome`
    against the same plain-PyTorch reference (the forward is the same)."""
    from .delegation import run

    return run(job, model_name, timeout, script=without_forwarding_script, label=model_name + WITHOUT_FORWARDING)


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`bug_shows` (the sweep's check: TinyMLP with
    its output layer in PEFT's ``ModulesToSaveWrapper``, then in a delegating wrapper with a parameter of its own,
    one rank, fp32, two SGD steps, against plain PyTorch): ZeRO-3, then ZeRO-2 instead (the same config and
    models), and the same wrappers under ZeRO-3 with ``nn.Module``'s own ``__getattr__`` (nothing forwarded to the
    wrapped module). Every cell runs on one rank, as the sweep's check does: this release's ZeRO-2 on two CPU
    ranks fails at its first step with entry zero12-flat-buffer-detach's error, and the rank count is no
    condition of this bug."""
    from ...harness import Cell, trigger_job
    from .delegation import job

    base = job()
    zero2 = base.with_(zero_stage=2, config={"zero_optimization": {**base.config["zero_optimization"], "stage": 2}})
    wrapper = ("getattr-wrapper",)
    return [Cell("ZeRO-3, output layer in an attribute-delegating wrapper (PEFT's, and one with its own parameter)",
                 trigger_job(base, 1, uses=wrapper), lambda: bug_shows(base)),
            Cell("ZeRO-2 instead", trigger_job(zero2, 1, uses=wrapper), lambda: bug_shows(zero2), "zero_stage"),
            Cell("the same wrappers without __getattr__ forwarding", trigger_job(base, 1),
                 lambda: bug_shows(base, forwarding=False), "uses:getattr-wrapper")]


def bench_job() -> Any:
    """The bench job (``python -m ci.bench``): the fix answers every ``hasattr`` of ZeRO-3's module hooks, so it
    is on the training path of every ZeRO-3 model."""
    from ... import harness

    return harness.bench_job(zero_stage=3)
