"""How gradient-clipping-default-1 is measured: the fast check the release sweep runs (``reproduce()``: True
where the installed DeepSpeed has the new default, i.e. a config without ``gradient_clipping`` clips), with
no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its probe.

The harness pins ``"gradient_clipping": 0.0`` in every job (``harness.ds_config``), so this entry builds its
engines from :func:`user_config`: the harness's config with that key removed, as a user's config that never
set it. Also what the notebook shares with it: :func:`train_user_job` (the user's training loop) and
:func:`train_reference_clipped` (plain PyTorch with ``torch.nn.utils.clip_grad_norm_``).
"""
from __future__ import annotations

import copy
from typing import Any

# A job whose global gradient norm is above 1.0 on every step (about 1.2 - 1.7 with the harness's tiny MLP
# and data), so clipping at 1.0 changes every update.
STEPS = 3
KEY = "gradient_clipping"


def job(zero_stage: int = 2, dtype: str = "float32", steps: int = STEPS) -> Any:
    """The harness job the check trains (SGD, lr 0.1, the tiny MLP, one process)."""
    from ...harness import Job

    return Job(zero_stage=zero_stage, dtype=dtype, steps=steps)


def user_config(run: Any, **settings: Any) -> dict[str, Any]:
    """``harness.ds_config(run)`` without the ``gradient_clipping`` key the harness pins, plus
    ``settings`` (e.g. ``gradient_clipping=1.0`` for a config that sets it)."""
    from ...harness import ds_config

    config = ds_config(run)
    del config[KEY]
    config.update(settings)
    return config


def train_user_job(run: Any, config: dict[str, Any]) -> Any:
    """``deepspeed.initialize`` with ``config`` and the user's loop (forward, ``engine.backward``,
    ``engine.step``) for ``run``; returns (engine, :class:`~fixes.harness.TrainResult`)."""
    import deepspeed
    import torch

    from ...harness import TinyMLP, TrainResult, device, dtype_of, gathered_params, make_batches, mse

    model = TinyMLP(run.model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=run.lr),
                                           config=config)
    batches = make_batches(run.model, run.steps, 1, 1, run.micro_batch, run.data_seed)
    losses, norms = [], []
    for step in range(run.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype_of(run.dtype))), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return engine, TrainResult(gathered_params(engine.module), losses, norms, type(engine.optimizer).__name__)


def train_reference_clipped(run: Any, max_norm: float) -> Any:
    """Plain PyTorch for ``run`` (one process, one micro-batch per step), the global gradient norm clipped
    to ``max_norm`` with ``torch.nn.utils.clip_grad_norm_`` before each step (0: no clipping, the same as
    ``harness.train_reference``). Low-precision dtypes keep fp32 master weights, as the harness does."""
    import torch

    from ...harness import TinyMLP, TrainResult, dtype_of, make_batches, mse, original_functional_linear

    if run.micro_steps != 1 or run.backwards != 1:
        raise ValueError("train_reference_clipped models one micro-batch per step")
    dtype = dtype_of(run.dtype)
    batches = make_batches(run.model, run.steps, 1, 1, run.micro_batch, run.data_seed)
    with original_functional_linear():
        master = TinyMLP(run.model)
        work = copy.deepcopy(master).to(dtype)
        with torch.no_grad():
            for param, low in zip(master.parameters(), work.parameters()):
                param.copy_(low.float())
        optimizer = torch.optim.SGD(master.parameters(), lr=run.lr)
        losses, norms = [], []
        for step in range(run.steps):
            optimizer.zero_grad()
            x, y = batches.micro(step, 0, 0)
            loss = mse(work(x.to(dtype)), y)
            grads = torch.autograd.grad(loss, list(work.parameters()))
            for param, grad in zip(master.parameters(), grads):
                param.grad = grad.float()
            losses.append(loss.item())
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in master.parameters()]))))
            if max_norm > 0:
                torch.nn.utils.clip_grad_norm_(list(master.parameters()), max_norm)
            optimizer.step()
            with torch.no_grad():
                for param, low in zip(master.parameters(), work.parameters()):
                    low.copy_(param)
        params = {name: p.detach().float().numpy().copy() for name, p in work.named_parameters()}
    return TrainResult(params, losses, norms, type(optimizer).__name__)


def reproduce() -> bool:
    """A ZeRO-2 fp32 job whose gradient norm is above 1.0, built from a config without
    ``gradient_clipping``: True if its weights differ from plain PyTorch without clipping beyond the fp32
    tolerance (the engine clipped), False if they match."""
    from ...exceptions import CannotTellError
    from ...harness import compare, train_reference

    run = job()
    reference = train_reference(run)
    if min(reference.grad_norms) <= 1.0:
        raise CannotTellError(f"the job's gradient norms {reference.grad_norms} are not all above 1.0: clipping at "
                              "1.0 would not change every step")
    _, trained = train_user_job(run, user_config(run))
    return not compare(trained.params, reference.params, run.dtype, "no gradient_clipping key vs plain PyTorch").close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's ZeRO-2 fp32 job (gradient norm above 1.0 on every
    step) from a config without ``gradient_clipping``, then the same config with ``"gradient_clipping": 0.0`` set
    explicitly. Each cell trains the user's loop and tells whether its weights differ from plain PyTorch without
    clipping (what a config that does not ask for clipping, and an explicit 0.0, meant before the new default)."""
    from ...harness import Cell, compare, train_reference, trigger_job

    run = job()

    def clipped(config: dict[str, Any]) -> bool:
        _, trained = train_user_job(run, config)
        return not compare(trained.params, train_reference(run).params, run.dtype, "vs plain PyTorch").close

    def cell(label: str, config: dict[str, Any], flips: str = "") -> Cell:
        return Cell(label, trigger_job(config), lambda: clipped(config), flips)

    return [cell("no gradient_clipping in the config", user_config(run)),
            cell("gradient_clipping: 0.0 set explicitly", user_config(run, gradient_clipping=0.0), "gradient_clipping")]
