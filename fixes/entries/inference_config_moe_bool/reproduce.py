"""How inference-config-moe-bool is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: :func:`init_inference` (the user's call, on a ``TinyMLP`` of its own),
:func:`moe_bool_error` (whether an exception is this bug's validation error), :func:`inputs` and
:func:`reference_outputs` (the same model in plain PyTorch, in the same dtype).

The user's call is ``deepspeed.init_inference(model, moe=True, dtype=torch.float32)``: the older form of the MoE
setting, a bool, which ``DeepSpeedInferenceConfig`` still types as ``Union[bool, DeepSpeedMoEConfig]``. The dtype is
set because the inference config's default, float16, is not supported by DeepSpeed's CPU accelerator.
"""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

BATCH = 8  # rows of the input the Verify section runs through the engine
INPUT_SEED = 3


def init_inference(moe: Any = True, dtype: Any = None, as_config: bool = False, model: Any = None) -> Any:
    """``deepspeed.init_inference`` on ``model`` (a new ``TinyMLP`` by default) with ``moe`` as a keyword argument,
    or, with ``as_config``, in the config dict (``{"moe": moe, "dtype": dtype}``); ``moe=None`` leaves it unset.
    ``dtype``: float32 by default. Returns the engine."""
    import deepspeed
    import torch

    from ...harness import TinyMLP

    settings = {"dtype": dtype or torch.float32}
    if moe is not None:
        settings["moe"] = moe
    model = TinyMLP() if model is None else model
    if as_config:
        return deepspeed.init_inference(model, config=settings)
    return deepspeed.init_inference(model, **settings)


def moe_bool_error(exc: BaseException) -> bool:
    """Whether ``exc`` is this bug's error: pydantic's ValidationError for the ``moe`` field's nested ``moe`` (the
    location reads ``moe.moe`` under pydantic 2, ``moe -> moe`` under pydantic 1 and ``pydantic.v1``)."""
    text = str(exc)
    return type(exc).__name__ == "ValidationError" and ("moe.moe" in text or "moe -> moe" in text)


def shows(moe: Any = True, as_config: bool = False) -> bool:
    """True if ``init_inference`` with ``moe`` raises this bug's ValidationError, False if it builds the engine with
    the MoE setting asked for; CannotTellError on any other failure."""
    try:
        engine = init_inference(moe, as_config=as_config)
    except Exception as exc:  # noqa: BLE001 - only this bug's error is an answer
        if moe_bool_error(exc):
            return True
        raise CannotTellError(f"init_inference(moe={moe!r}) failed otherwise: {type(exc).__name__}: {exc}") from exc
    enabled = engine._config.moe.enabled
    wanted = moe if isinstance(moe, bool) else (moe or {}).get("enabled", True)
    if enabled is not wanted:
        raise CannotTellError(f"init_inference(moe={moe!r}) built an engine with moe.enabled={enabled}")
    return False


def reproduce() -> bool:
    """``deepspeed.init_inference(model, moe=True, dtype=torch.float32)``: True if it raises the ValidationError for
    ``moe.moe``, False if it builds the engine with ``moe.enabled`` True."""
    return shows(True)


def inputs(dtype: Any) -> Any:
    import torch

    from ...harness import ModelSpec

    generator = torch.Generator().manual_seed(INPUT_SEED)
    return torch.randn(BATCH, ModelSpec().in_features, generator=generator).to(dtype)


def reference_outputs(dtype: Any) -> Any:
    """Plain PyTorch, no DeepSpeed: a ``TinyMLP`` built as the engine's is (same seed), cast to ``dtype``, on
    :func:`inputs`. Returns the outputs (on CPU)."""
    import torch

    from ...harness import TinyMLP, device

    place = device()
    model = TinyMLP().to(place, dtype)
    with torch.no_grad():
        return model(inputs(dtype).to(place)).cpu()


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell one ``init_inference`` call on one process:
    does it raise the ValidationError for ``moe.moe``? With every condition: ``moe=True`` as a keyword argument,
    and ``{"moe": false}`` in the config dict (both bools). Flipped (the use off): the MoE setting as a dict
    (``moe={"enabled": True}``, its current form), and no MoE setting at all."""
    from ...harness import Cell, trigger_job

    use = ["init-inference-moe-bool"]
    flip = "uses:init-inference-moe-bool"
    return [Cell("init_inference(model, moe=True)", trigger_job({}, 1, use), lambda: shows(True)),
            Cell("init_inference(model, config={\"moe\": false})", trigger_job({}, 1, use),
                 lambda: shows(False, as_config=True)),
            Cell("init_inference(model, moe={\"enabled\": True}) (the dict form)", trigger_job({}, 1, []),
                 lambda: shows({"enabled": True}), flip),
            Cell("init_inference(model) with no moe setting", trigger_job({}, 1, []), lambda: shows(None), flip)]
