"""The user's model and runs of zero3-overwrites-module-id: a small mixture of experts in which every expert keeps
its own index in ``self.id`` (as in upstream issue #6772, where ``module.id`` decided which expert went to which
GPU), trained under ZeRO-3 on one rank, and the same model in plain PyTorch.

The model: ``fc1 → tanh``, then two experts, each a ``Linear(hidden, out)``. Routing is fixed, hash-style: sample
``i`` of a batch goes to the expert whose ``id`` is ``i % number of experts``; every expert computes its
projection and keeps the rows routed to it (``routes == self.id``). Where ``id`` holds another value the expert
keeps no rows: its output, and every gradient through it, is zero.

Two spellings of the expert's ``id``:

* :class:`Expert` -- an instance attribute set in ``__init__`` (``self.id = expert_id``), the common case;
* :class:`PropertyExpert` -- a read-only property computed from the expert's route (``self.route``): a class
  that exposes ``id`` without letting it be assigned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ...harness.versus import ScriptOutcome

NUM_EXPERTS = 2
ATTRIBUTE = "expert id as an attribute"
PROPERTY = "expert id as a read-only property"
# What assigning ZeRO-3's number to the read-only property raises (AttributeError): Python 3.11 and later say
# "property 'id' of 'PropertyExpert' object has no setter", earlier ones "can't set attribute"
PROPERTY_ERRORS = ("property 'id' of", "can't set attribute")


class Expert(torch.nn.Module):
    """One expert: its projection, applied to the rows routed to it (``routes == self.id``)."""

    def __init__(self, expert_id: int, hidden: int, out_features: int) -> None:
        from ...harness.models import SeededLinear

        super().__init__()
        self.id = expert_id  # the user's own: which route this expert serves (and, in a real job, its device)
        self.proj = SeededLinear(hidden, out_features)

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return self.proj(h) * (routes == self.id).unsqueeze(-1).to(h.dtype)


class PropertyExpert(torch.nn.Module):
    """:class:`Expert` whose ``id`` is a read-only property of its route."""

    def __init__(self, expert_id: int, hidden: int, out_features: int) -> None:
        from ...harness.models import SeededLinear

        super().__init__()
        self.route = expert_id
        self.proj = SeededLinear(hidden, out_features)

    @property
    def id(self) -> int:
        return self.route

    def forward(self, h: torch.Tensor, routes: torch.Tensor) -> torch.Tensor:
        return self.proj(h) * (routes == self.id).unsqueeze(-1).to(h.dtype)


class RoutedExperts(torch.nn.Module):
    """``fc1 → tanh``, then the experts; sample ``i`` goes to the expert with ``id == i % len(experts)``."""

    def __init__(self, spec: Any, expert: type = Expert) -> None:
        from ...harness.models import SeededLinear

        super().__init__()
        with torch.random.fork_rng(devices=[]):  # the same weights wherever it is built (as the harness's TinyMLP)
            torch.manual_seed(spec.seed)
            self.fc1 = SeededLinear(spec.in_features, spec.hidden)
            self.act = torch.nn.Tanh()
            self.experts = torch.nn.ModuleList(expert(k, spec.hidden, spec.out_features) for k in range(NUM_EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        routes = torch.arange(x.shape[0], device=x.device) % len(self.experts)
        out = torch.zeros(x.shape[0], self.experts[0].proj.out_features, device=x.device, dtype=h.dtype)
        for expert in self.experts:
            out = out + expert(h, routes)
        return out


MODELS: dict[str, Callable[[Any], torch.nn.Module]] = {
    ATTRIBUTE: lambda spec: RoutedExperts(spec, Expert),
    PROPERTY: lambda spec: RoutedExperts(spec, PropertyExpert),
}


def expert_ids(model: torch.nn.Module) -> dict[str, Any]:
    """``{expert's name: what its id reads}``."""
    return {f"experts.{k}": getattr(expert, "id", "<none>") for k, expert in enumerate(model.experts)}


def deepspeed_numbers(model: torch.nn.Module) -> dict[str, Any]:
    """``{expert's name: module.ds_id}``, where ZeRO-3 keeps its number after upstream's fix (``-`` if none)."""
    return {f"experts.{k}": vars(expert).get("ds_id", "-") for k, expert in enumerate(model.experts)}


def job(dtype: str = "float32", **changes: Any) -> Any:
    """The harness job of this entry: ZeRO-3 on one rank, every parameter released after use
    (``stage3_param_persistence_threshold: 0``, as for a real model's large layers), two SGD steps."""
    from ...harness import Job

    return Job(zero_stage=3, dtype=dtype, steps=2,
               config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


def user_script(job: Any, model_name: str = ATTRIBUTE) -> dict[str, Any]:
    """One rank of the user's training script: the model, SGD, ``deepspeed.initialize`` with the job's config
    dict, then forward, ``engine.backward``, ``engine.step``. Returns each expert's ``id`` before and after
    ``deepspeed.initialize`` (and ZeRO-3's ``ds_id``), the trained parameters (gathered, fp32) and the losses."""
    import deepspeed

    from ...harness import allow_fp16_on_cpu, device, ds_config, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    dtype = dtype_of(job.dtype)
    if dtype == torch.float16:
        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    model = MODELS[model_name](job.model)
    ids_before = expert_ids(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=job.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(job))
    ids_after = expert_ids(engine.module)
    numbers = deepspeed_numbers(engine.module)
    batches = make_batches(job.model, job.steps, 1, 1, job.micro_batch, job.data_seed)
    losses = []
    for step in range(job.steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device(), dtype)), y.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"ids_before": ids_before, "ids_after": ids_after, "ds_ids": numbers,
            "params": gathered_params(engine.module), "losses": losses}


@dataclass
class Outcome(ScriptOutcome):
    """One model's run through DeepSpeed (one launched rank) next to its plain-PyTorch reference, with each
    expert's ``id`` before and after ``deepspeed.initialize`` and ZeRO-3's own numbers."""

    ids_before: dict[str, Any] = field(default_factory=dict)
    ids_after: dict[str, Any] = field(default_factory=dict)
    ds_ids: dict[str, Any] = field(default_factory=dict)

    @property
    def bug_error(self) -> bool:
        """The run failed where ZeRO-3 assigns ``module.id`` to a read-only property."""
        if self.error is None or self.error.exc_type != "AttributeError":
            return False
        return any(text in self.error.message for text in PROPERTY_ERRORS)

    @property
    def ids_kept(self) -> bool:
        return self.error is None and self.ids_after == self.ids_before

    @property
    def shows_bug(self) -> bool:
        return self.bug_error or (self.error is None and (not self.ids_kept or not self.matches))


def run(job: Any, model_name: str = ATTRIBUTE, timeout: float = 180.0) -> Outcome:
    """:func:`user_script` on one launched rank (a fresh process: every fix applied here is applied there
    first), and its plain-PyTorch reference (:func:`fixes.harness.train_reference` of the same model: SGD on fp32
    master weights, as DeepSpeed's mixed-precision optimizers keep them). A failed run keeps the rank's error."""
    from ...harness import launch_script, train_reference

    outcome = Outcome(model_name, job.dtype)
    result = launch_script(outcome, user_script, job, model_name, timeout=timeout)
    if result is not None:
        outcome.ids_before, outcome.ids_after, outcome.ds_ids = result["ids_before"], result["ids_after"], result["ds_ids"]
        outcome.set_reference(train_reference(job, build_model=MODELS[model_name]))
    return outcome
