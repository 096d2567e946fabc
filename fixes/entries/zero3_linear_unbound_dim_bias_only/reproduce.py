"""How zero3-linear-unbound-dim-bias-only is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

Also what the notebook shares with it: the user's model (:func:`bias_only`: the harness's ``TinyMLP`` with every
``weight`` frozen, BitFit-style), the user's script as one rank (:func:`user_script`), and the same training in
plain PyTorch (:func:`train_reference`). Every DeepSpeed run is a fresh rank: ``deepspeed.zero.Init`` replaces
``torch.nn.functional.linear`` for the rest of the process it runs in.
"""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

ERROR = "UnboundLocalError"
STEPS = 3


def job(dtype: str = "float32", zero3_init: bool = True, zero_stage: int = 3, **config: Any) -> Any:
    """The user's job: ZeRO-3, the model built inside ``deepspeed.zero.Init``, ``STEPS`` SGD steps of lr 0.1 on
    micro-batches of 4; ``config`` is merged into ``zero_optimization``."""
    from ...harness import Job

    zero = {"zero_optimization": {"stage": zero_stage, **config}} if config else {}
    return Job(zero_stage=zero_stage, dtype=dtype, steps=STEPS, zero3_init=zero3_init, config=zero)


def bias_only(model: Any) -> Any:
    """Freeze every ``weight`` of ``model``, leaving the biases trainable (BitFit); returns the model."""
    for name, param in model.named_parameters():
        if name.endswith("weight"):
            param.requires_grad_(False)
    return model


def user_script(job: Any) -> dict[str, Any]:
    """One rank of the user's script (for :func:`fixes.harness.launch`): the model built inside
    ``deepspeed.zero.Init`` (where ``job.zero3_init``), its weights frozen, ``deepspeed.initialize`` with SGD over the
    trainable parameters, then ``job.steps`` steps of forward, ``engine.backward``, ``engine.step``. Returns every
    parameter, gathered (fp32), and the losses."""
    import deepspeed
    import torch

    from ... import harness

    config = harness.ds_config(job)
    dtype = harness.dtype_of(job.dtype)
    if dtype == torch.float16:
        harness.allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16
    if job.zero3_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = harness.TinyMLP(job.model)
    else:
        model = harness.TinyMLP(job.model)
    bias_only(model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    batches = harness.make_batches(job.model, job.steps)
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = harness.mse(engine(x.to(harness.device(), dtype)), y.to(harness.device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"params": harness.gathered_params(engine.module), "losses": losses}


def after_another_zero_init(job: Any) -> dict[str, Any]:
    """One rank: another module built inside ``deepspeed.zero.Init`` first and dropped (as a process that loaded some
    model under ``zero.Init`` earlier), then :func:`user_script`."""
    import deepspeed

    from ... import harness

    with deepspeed.zero.Init(config_dict_or_path=harness.ds_config(job)):
        harness.TinyMLP(job.model)
    return user_script(job)


def train_reference(job: Any) -> dict[str, Any]:
    """``job`` in plain PyTorch (PyTorch's own ``F.linear``): the same ``TinyMLP`` with its weights frozen, SGD on
    the biases. In bf16/fp16 the model is held in that dtype and the biases' fp32 master copies take the steps, as
    DeepSpeed's optimizers keep them. Returns the parameters (fp32) and the losses, as :func:`user_script`."""
    import copy

    import torch

    from ...harness import TinyMLP, dtype_of, make_batches, mse, original_functional_linear

    dtype = dtype_of(job.dtype)
    with original_functional_linear():
        master = bias_only(TinyMLP(job.model))
        work = bias_only(copy.deepcopy(master).to(dtype))
        trainable = [(name, p) for name, p in master.named_parameters() if p.requires_grad]
        with torch.no_grad():  # DeepSpeed makes the fp32 masters from the model in its dtype
            for name, param in trainable:
                param.copy_(work.get_parameter(name).float())
        optimizer = torch.optim.SGD([p for _, p in trainable], lr=job.lr)
        batches = make_batches(job.model, job.steps)
        losses = []
        for step in range(job.steps):
            x, y = batches.micro(step, 0, 0)
            loss = mse(work(x.to(dtype)), y)
            grads = torch.autograd.grad(loss, [work.get_parameter(name) for name, _ in trainable])
            for (_, param), grad in zip(trainable, grads):
                param.grad = grad.float()
            optimizer.step()
            with torch.no_grad():
                for name, param in trainable:
                    work.get_parameter(name).copy_(param)
            losses.append(loss.item())
        params = {name: p.detach().float().numpy().copy() for name, p in work.named_parameters()}
    return {"params": params, "losses": losses}


def is_this_bug(error: Any) -> bool:
    """Whether a rank's failure (:class:`~fixes.exceptions.RankFailedError`) is this bug: ``UnboundLocalError`` on
    ``dim``, raised in ``backward`` of DeepSpeed's ``deepspeed/runtime/zero/linear.py``."""
    return (error.exc_type == ERROR and "'dim'" in error.message
            and "zero/linear.py" in error.traceback and "in backward" in error.traceback)


def run(job: Any, timeout: float = 180.0, script: Any = None) -> dict[str, Any]:
    """``script`` (:func:`user_script` by default) in a fresh rank, next to :func:`train_reference`:
    ``{"error": RankFailedError or None, "result": ..., "reference": ...}``."""
    from ...exceptions import RankFailedError
    from ...harness import launch

    outcome: dict[str, Any] = {"error": None, "result": None, "reference": train_reference(job)}
    try:
        [outcome["result"]] = launch(script or user_script, 1, job, timeout=timeout)
    except RankFailedError as error:
        outcome["error"] = error
    return outcome


def bug_shows(job: Any, script: Any = None) -> bool:
    """True if the user's script raises this bug's error; False if it trains as plain PyTorch does (every
    parameter within ``TOLERANCES``: the biases trained, the weights unchanged); CannotTellError otherwise."""
    from ...harness import compare

    outcome = run(job, script=script)
    error = outcome["error"]
    if error is not None:
        if is_this_bug(error):
            return True
        raise CannotTellError(f"the run failed otherwise: {error.exc_type}: {error.message}"[:300])
    comparison = compare(outcome["result"]["params"], outcome["reference"]["params"], job.dtype, "parameters")
    if not comparison.close:
        raise CannotTellError(f"the run trained but differs from plain PyTorch: {comparison}")
    return False


def reproduce() -> bool:
    """The user's job (:func:`job`: ZeRO-3, the model built inside ``zero.Init``, weights frozen, fp32) in a fresh
    rank: True if a training step raises ``UnboundLocalError`` on ``dim`` in DeepSpeed's ZeRO-3 linear backward,
    False if it trains as plain PyTorch does."""
    return bug_shows(job())


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`bug_shows` on one fresh rank, fp32, every
    Linear's weight frozen and bias trainable: the sweep's job (ZeRO-3, the model built inside ``zero.Init``); the
    same model built outside ``zero.Init`` (``deepspeed.initialize`` partitions it; ``F.linear`` stays PyTorch's);
    and ZeRO-2 over the model built outside ``zero.Init`` after ``zero.Init`` ran in the process for another model,
    which fails the same way: the stage does not matter, ``zero.Init`` having replaced ``F.linear`` in the process
    does (the trigger has no stage condition). A model built inside ``zero.Init`` does not run under ZeRO-2 at all
    (its parameters stay partitioned), hence that cell's shape. Frozen weights with trainable biases are a condition
    too, but no field of a job states them (the trigger's note does): with every parameter trainable the weight's
    branch assigns ``dim`` first, so no cell flips it."""
    from ...harness import Cell, trigger_job

    base = job()
    no_init = job(zero3_init=False)
    zero2 = job(zero_stage=2, zero3_init=False)
    return [Cell("ZeRO-3, zero.Init, Linear weights frozen and biases trainable",
                 trigger_job(base, 1, uses=("zero-init",)), lambda: bug_shows(base)),
            Cell("the model built outside zero.Init", trigger_job(no_init, 1), lambda: bug_shows(no_init),
                 "uses:zero-init"),
            Cell("ZeRO-2, the model built after zero.Init ran in the process for another model",
                 trigger_job(zero2, 1, uses=("zero-init",)), lambda: bug_shows(zero2, after_another_zero_init),
                 "zero_stage")]
