"""The user's script of zero3-deepcopy-zero-ordered-dict: a ZeRO-3 engine over the harness's TinyMLP, then an
EMA / reference copy of its module with ``copy.deepcopy``, then training. Used by ``reproduce()`` (through
:func:`fixes.harness.launch`, one rank), the tests and the notebook (in its own process).

What a copy of a ZeRO-3 module is, once ``deepcopy`` works (measured on fixed releases, see the notebook):

* ``copy.deepcopy(engine.module)`` copies each partitioned parameter as ``torch.nn.Parameter.__deepcopy__``
  does: the local ``data`` only, which ZeRO-3 has released (a tensor of shape ``(0,)``), and none of the
  ``ds_*`` attributes. Its weights are gone; a forward fails in the copied ZeRO-3 hooks.
* made inside ``deepspeed.zero.GatheredParameters`` over the model's parameters, the copy holds the full
  weights (plain tensors, equal to the original's). It still carries the ZeRO-3 module hooks copied from the
  original; given to a ``deepspeed.initialize`` of its own (the reference model of RLHF/DPO trainers), its
  forward equals the engine's.
"""
from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ERROR = ("TypeError", 'can only concatenate tuple (not "list") to tuple')


def job(dtype: str = "float32", **changes: Any) -> Any:
    """The harness job of this entry: ZeRO-3 on one rank, every parameter released after use
    (``stage3_param_persistence_threshold: 0``, as a real model's large layers are), two SGD steps."""
    from ...harness import Job

    return Job(zero_stage=3, dtype=dtype, steps=2,
               config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


def zero2_job(dtype: str = "float32") -> Any:
    """:func:`job` under ZeRO-2 instead (the same config otherwise)."""
    return job(dtype).with_(zero_stage=2, config={"zero_optimization": {"stage": 2,
                                                                        "stage3_param_persistence_threshold": 0}})


def initialize(job: Any) -> Any:
    """``deepspeed.initialize`` of TinyMLP with SGD and the job's config dict; returns the engine."""
    import deepspeed
    import torch

    from ...harness import TinyMLP, ds_config

    model = TinyMLP(job.model)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    return engine


def ema_copy(engine: Any, gathered: bool = True) -> Any:
    """The EMA / reference copy: ``copy.deepcopy(engine.module)``, inside ``deepspeed.zero.GatheredParameters``
    over its parameters where ``gathered`` (under ZeRO-3 a parameter outside it holds no weights)."""
    import deepspeed

    if not gathered:
        return copy.deepcopy(engine.module)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return copy.deepcopy(engine.module)


def raised_where(exc: BaseException) -> str:
    """``file:function`` of the innermost frame of ``exc``'s traceback."""
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{frame.filename.replace(chr(92), '/').split('/deepspeed/', 1)[-1]}:{frame.name}"


def train(engine: Any, job: Any) -> list[float]:
    """The training loop: forward, ``engine.backward(loss)``, ``engine.step()``; returns the losses."""
    from ...harness import device, dtype_of, make_batches, mse

    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def user_script(job: Any, gathered: bool = True) -> dict[str, Any]:
    """One rank of the user's script: :func:`initialize`, :func:`ema_copy`, then :func:`train` the engine.
    Returns the error the copy raised (``error``: type, message, where) or the copy's parameters and shapes,
    the engine's gathered parameters before and after training, and the losses."""
    from ...harness import gathered_params

    engine = initialize(job)
    before = gathered_params(engine.module)
    try:
        ema = ema_copy(engine, gathered)
    except Exception as exc:  # noqa: BLE001 - the bug's error is the result
        return {"error": (type(exc).__name__, str(exc), raised_where(exc))}
    shapes = {name: tuple(p.shape) for name, p in ema.named_parameters()}
    copied = {name: p.detach().float().cpu().numpy().copy() for name, p in ema.named_parameters()}
    losses = train(engine, job)
    return {"error": None, "shapes": shapes, "copy": copied, "before": before,
            "after": gathered_params(engine.module), "losses": losses, "copy_after": {
                name: p.detach().float().cpu().numpy().copy() for name, p in ema.named_parameters()}}


@dataclass
class Outcome:
    """One run of :func:`user_script` and its plain-PyTorch reference."""

    dtype: str
    error: tuple[str, str, str] | None = None
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def bug_error(self) -> bool:
        return self.error is not None and self.error[:2] == ERROR and self.error[2].endswith("__reduce__")


def run(job: Any, gathered: bool = True, timeout: float = 180.0) -> Outcome:
    """:func:`user_script` on one launched rank. A rank failing elsewhere than in the copy raises."""
    from ...harness import launch

    [result] = launch(user_script, 1, job, gathered, timeout=timeout)
    error = result["error"]
    return Outcome(job.dtype, tuple(str(part) for part in error) if error is not None else None, result)


def initial_params(job: Any) -> dict[str, np.ndarray]:
    """TinyMLP's weights before training, fp32 (the model plain PyTorch starts from)."""
    from ...harness import TinyMLP

    return {name: p.detach().float().numpy().copy() for name, p in TinyMLP(job.model).named_parameters()}
