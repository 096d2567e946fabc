"""The user's script of zero3-reload-states-wrong-order and its plain-PyTorch reference.

The script is the training side of an RLHF loop (OpenRLHF, verl and similar frameworks do this between
rollouts): ZeRO-3 with DeepSpeed's Adam from the config, the optimizer over the two parameter groups of Hugging
Face's Trainer (weights with weight decay, biases without: :func:`fixes.harness.schedules.param_groups`), one
training step, then ``engine.offload_states()`` (the generation would run here, with the training states off
the device) and ``engine.reload_states()`` before the next training step, and so on.

``engine.offload_states()`` accepts DeepSpeed's ``FusedAdam`` only (an assertion in
``DeepSpeedZeroOptimizer_Stage3.offload_states``); the config's ``"optimizer": {"type": "AdamW"}`` builds it
(on the CPU accelerator its op is compiled once per release, on first use). Newer releases assert so only where
the optimizer's states or fp32 master weights are offloaded: there the same loop can run with the script's own
``torch.optim.AdamW`` (:data:`TORCH_ADAMW`: the config without its ``"optimizer"``, nothing compiled) and
``engine.offload_states(include=[OffloadStateTypeEnum.lp_params])``, the parameters whose mapping the bug is in.
The release sweep and the tests run the user's own: :data:`CONFIG_ADAMW` and everything offloaded.

The reference is the same model and data in plain PyTorch: ``torch.optim.AdamW`` over the same groups, fp32
master weights for a bf16 model, as DeepSpeed keeps them, and no offload (moving states to the CPU and back
changes no value).

One rank: the parameter partition is then the whole parameter, and nothing here needs more ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...harness.versus import ScriptOutcome

LR = 1e-2
STEPS = 3
SPLIT = "weights with weight decay, biases without"
ONE_GROUP = "one parameter group"
ZERO3_ONLY = "supported only for ZeRO stage 3"  # engine.offload_states' assertion under ZeRO-1/2
DEFAULTS: dict[str, Any] = {}  # engine.offload_states() with its defaults: everything, to the CPU, pinned
CONFIG_ADAMW = "DeepSpeed's AdamW from the config (FusedAdam)"
TORCH_ADAMW = "torch.optim.AdamW from the script"
FUSED_ADAM_ONLY = "Offloading is supported only for DeepSpeed FusedAdam"  # engine.offload_states' assertion


def job(dtype: str = "float32", zero_stage: int = 3, adamw: str = CONFIG_ADAMW, **changes: Any) -> Any:
    """The harness job of the script: ZeRO-3 on one rank, every parameter released after use
    (``stage3_param_persistence_threshold: 0``, what a real model's large layers get), DeepSpeed's AdamW from
    the config at lr 1e-2 (the groups set their own weight decay), :data:`STEPS` optimizer steps.
    ``adamw=TORCH_ADAMW``: the same config without its ``"optimizer"`` section (:func:`user_script` then makes
    ``torch.optim.AdamW`` over the groups)."""
    from ...harness import Job

    if adamw not in (CONFIG_ADAMW, TORCH_ADAMW):
        raise ValueError(f"unknown adamw {adamw!r}; use {CONFIG_ADAMW!r} or {TORCH_ADAMW!r}")
    zero: dict[str, Any] = {"stage": zero_stage}
    if zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config: dict[str, Any] = {"zero_optimization": zero}
    if adamw == CONFIG_ADAMW:
        config = {"optimizer": {"type": "AdamW", "params": {"lr": LR}}, **config}
    return Job(zero_stage=zero_stage, dtype=dtype, steps=STEPS, lr=LR, config=config).with_(**changes)


def optimizer_groups(model: torch.nn.Module, groups: str = SPLIT) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: Hugging Face Trainer's weight-decay split (:data:`SPLIT`: the weight
    matrices, then the biases), or every parameter in one group in the model's order (:data:`ONE_GROUP`)."""
    from ...harness.schedules import param_groups

    if groups == SPLIT:
        return param_groups(model, (LR, LR))
    if groups == ONE_GROUP:
        return [{"params": list(model.parameters()), "lr": LR, "weight_decay": 0.0}]
    raise ValueError(f"unknown groups {groups!r}; use {SPLIT!r} or {ONE_GROUP!r}")


def user_script(job: Any, groups: str = SPLIT, offload: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank of the user's loop: ``deepspeed.initialize`` with the optimizer's parameter groups
    (:func:`initialize`), then for every step after the first ``engine.offload_states(**offload)`` and
    ``engine.reload_states()``, then forward, ``engine.backward``, ``engine.step``. ``offload=None``: no
    offload/reload (a plain run). Returns the trained parameters (gathered, fp32), the losses and the optimizer's
    class."""
    from ...harness import TinyMLP, device, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    model = TinyMLP(job.model)
    engine = initialize(model, job, groups)
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses = []
    for step in range(job.steps):
        if step > 0 and offload is not None:
            engine.offload_states(**offload)  # free the device for generation ...
            engine.reload_states()  # ... and bring the training states back
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"params": gathered_params(engine.module), "losses": losses,
            "optimizer": type(engine.basic_optimizer).__name__}


def initialize(model: torch.nn.Module, job: Any, groups: str = SPLIT) -> Any:
    """The user's ``deepspeed.initialize`` with the optimizer's parameter groups: DeepSpeed's AdamW where the
    config has an ``"optimizer"`` section (:data:`CONFIG_ADAMW`), else the script's own ``torch.optim.AdamW``
    (:data:`TORCH_ADAMW`). Returns the engine."""
    import deepspeed

    from ...harness import ds_config

    config = ds_config(job)
    params = optimizer_groups(model, groups)
    if "optimizer" in config:  # DeepSpeed builds its AdamW (FusedAdam) over the groups
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
    else:  # the script's own optimizer over the groups
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(params), config=config)
    return engine


@dataclass
class Outcome(ScriptOutcome):
    """One run of :func:`user_script` in a launched rank, next to its plain-PyTorch reference, and the class of
    the optimizer DeepSpeed built."""

    optimizer: str = ""


def run(job: Any, groups: str = SPLIT, offload: dict[str, Any] | None = DEFAULTS, label: str = "",
        timeout: float = 300.0) -> Outcome:
    """:func:`user_script` in one freshly launched rank (the fixes applied here are applied there), and its
    plain-PyTorch reference here: :func:`fixes.harness.train_reference` with ``torch.optim.AdamW`` over
    :func:`optimizer_groups` of the fp32 master model (for bf16, gradients from the model in bf16, as DeepSpeed
    makes its fp32 partitions), and no offload (moving states to the CPU and back changes no value).
    ``offload``: the arguments of ``engine.offload_states`` (its defaults unless given; None: no offload/reload).
    A rank that raises is kept in ``error``."""
    from ...harness import launch_script, train_reference

    outcome = Outcome(label or groups, job.dtype)
    outcome.set_reference(train_reference(
        job, build_optimizer=lambda master: torch.optim.AdamW(optimizer_groups(master, groups))))
    result = launch_script(outcome, user_script, job, groups, None if offload is None else dict(offload),
                           timeout=timeout)
    if result is not None:
        outcome.optimizer = str(result["optimizer"])
    return outcome


def partitions_after_reload(job: Any, groups: str = SPLIT, offload: dict[str, Any] = DEFAULTS) -> list[dict[str, Any]]:
    """One rank (for :func:`fixes.harness.launch`): the user's engine after one training step, each parameter's
    partition (``param.ds_tensor``, what ZeRO-3 gathers the parameter from) read before
    ``engine.offload_states(**offload)`` and after ``engine.reload_states()``. Per parameter: where its partition
    lies in the flat parameter buffer (``lp_param_buffer``, laid out in the optimizer's order: ``fp16_groups``),
    where it lies after ``reload_states``, and whether it still holds its own values."""
    from ...harness import TinyMLP, device, make_batches, mse
    from ...harness.compare import dtype_of

    model = TinyMLP(job.model)
    engine = initialize(model, job, groups)
    x, y = make_batches(job.model, 1, 1, 1, job.micro_batch, job.data_seed).micro(0, 0, 0)
    engine.backward(mse(engine(x.to(device(), dtype_of(job.dtype))), y.to(device())))
    engine.step()
    optimizer = engine.optimizer
    names = {param: name for name, param in engine.module.named_parameters()}
    before = {name: param.ds_tensor.detach().clone() for param, name in names.items()}

    def offsets() -> dict[str, int]:
        base = optimizer.lp_param_buffer.data_ptr()
        size = optimizer.lp_param_buffer.element_size()
        return {name: (param.ds_tensor.data_ptr() - base) // size for param, name in names.items()}

    buffer_order = [names[param] for sub_group in optimizer.fp16_groups for param in sub_group]
    at_first = offsets()
    engine.offload_states(**offload)
    engine.reload_states()
    after = offsets()
    rows = []
    for name in buffer_order:
        param = next(p for p, n in names.items() if n == name)
        rows.append({"parameter": name, "values": param.ds_tensor.numel(), "offset in lp_param_buffer": at_first[name],
                     "offset after reload_states": after[name],
                     "holds its own values": bool(torch.equal(param.ds_tensor, before[name]))})
    return rows
