"""The user's job of zero3-stale-trace-after-hook-reregistration: a ZeRO-3 training loop that generates from each
step's prompts before training on them (an online RL trainer's loop: TRL's GRPO, PPO, RLOO, online DPO), on two
ranks, and the same loop in plain PyTorch.

The model is what a PEFT-wrapped causal LM is to DeepSpeed (:class:`PolicyModel`): an outer module whose
``forward`` runs the base model, and whose ``generate()`` calls the base model directly, as ``PeftModel.generate``
calls ``self.base_model.generate``. Generation therefore never runs the outer module's forward, where ZeRO-3's
start-of-forward hook sits. The base model is the harness's ``TinyMLP`` (8 features in, 4 out); ``generate()`` rolls
it out autoregressively: each output is appended to the 8-feature window, whose oldest 4 features drop out, and the
window is fed back in.

Around generation the trainer uses :func:`unwrap_for_generation`, TRL's ``unwrap_model_for_generation`` reduced to
what DeepSpeed sees: under ZeRO-3, DeepSpeed's own ``deepspeed.runtime.zero.unwrap_model_for_generation`` (gather
every parameter, remove ZeRO-3's module hooks, generate, register the hooks again); under ZeRO-1/2 the engine as it
is.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from ...exceptions import RankFailedError
from ...harness.models import ModelSpec, TinyMLP

WORLD_SIZE = 2
NEW_TOKENS = 3  # outputs generated per prompt
ERROR = ("IndexError", "pop from an empty deque")
RAISED_IN = "record_parameters"  # the function of DeepSpeed's that pops, in the rank's traceback


class PolicyModel(torch.nn.Module):
    """A base model inside an outer module, as PEFT puts a causal LM inside ``PeftModel``: ``forward`` runs the base
    model; ``generate`` calls the base model itself (the outer module's forward does not run)."""

    def __init__(self, spec: ModelSpec = ModelSpec()) -> None:
        super().__init__()
        self.base_model = TinyMLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model(x)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
        """``new_tokens`` outputs, each from the window of the last 8 features: ``[batch, new_tokens, 4]``."""
        window, outputs = prompt, []
        for _ in range(new_tokens):
            output = self.base_model(window)
            outputs.append(output)
            window = torch.cat([window[:, output.shape[1]:], output.to(window.dtype)], dim=1)
        return torch.stack(outputs, dim=1)


@contextlib.contextmanager
def unwrap_for_generation(engine: Any) -> Iterator[Any]:
    """The trainer's context for generation: under ZeRO-3, DeepSpeed's ``unwrap_model_for_generation`` (every
    parameter gathered, ZeRO-3's module hooks removed, and registered again when the block exits); otherwise the
    engine as it is (the parameters are whole on every rank)."""
    from deepspeed.runtime.zero import unwrap_model_for_generation

    if engine.zero_optimization_stage() == 3:
        with unwrap_model_for_generation(engine) as unwrapped:
            yield unwrapped
    else:
        yield engine


def job(dtype: str = "float32", **changes: Any) -> Any:
    """The harness job: ZeRO-3, every parameter partitioned (``stage3_param_persistence_threshold: 0``, as a real
    model's large layers are), SGD lr 0.1, three steps, 4 samples per rank."""
    from ...harness import Job

    return Job(zero_stage=3, dtype=dtype, steps=3,
               config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}).with_(**changes)


def user_script(job: Any) -> dict[str, Any]:
    """One rank of the user's training script: ``deepspeed.initialize`` with the job's config, then for each step:
    generate from this rank's prompts inside :func:`unwrap_for_generation`, then forward, ``engine.backward``,
    ``engine.step`` on the same prompts. Returns the completions, the losses and the trained parameters (gathered,
    fp32)."""
    import deepspeed

    from ...harness import allow_fp16_on_cpu, device, ds_config, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    dtype = dtype_of(job.dtype)
    if dtype == torch.float16:
        allow_fp16_on_cpu()  # CPU reproduction only: DeepSpeed's CPU accelerator refuses fp16; no-op on CUDA
    model = PolicyModel(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=job.lr),
                                           config=ds_config(job, world_size))
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)
    completions, losses = [], []
    for step in range(job.steps):
        prompts, targets = batches.micro(step, 0, rank)
        prompts = prompts.to(device(), dtype)
        with unwrap_for_generation(engine) as unwrapped:
            completions.append(unwrapped.generate(prompts).float().cpu().numpy())
        loss = mse(engine(prompts), targets.to(device()))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"completions": np.stack(completions), "losses": np.array(losses),
            "params": gathered_params(engine.module)}


@dataclass
class Reference:
    completions: np.ndarray  # [rank, step, batch, new_tokens, features]
    losses: np.ndarray  # [rank, step]
    params: dict[str, np.ndarray]


def plain_reference(job: Any, world_size: int = WORLD_SIZE) -> Reference:
    """The same loop in plain PyTorch data parallelism: each step, every rank's prompts generated with the model as
    it is before the step, then one SGD step on the gradient averaged over the ranks' shards. As
    ``harness.train_reference(job, world_size, grad_dtype=...)``: the model held in the job's dtype, fp32 master
    weights made from it (as DeepSpeed's bf16/fp16 optimizers keep). In bf16 and fp16 the ranks' gradients are
    summed and averaged in that dtype, then converted to fp32, as ZeRO-3 reduces them (its gradient reduce-scatter
    runs in the model's dtype; fp32 gradient accumulation is not configured); in fp32 each rank's gradient is
    divided by the number of ranks and added in fp32. Both are the harness's reference bit for bit (its tests hold
    it to torch DDP)."""
    from ...harness import make_batches, mse
    from ...harness.compare import dtype_of
    from ...harness.env import rank_placement
    from ...harness.training import make_optimizer, original_functional_linear

    dtype = dtype_of(job.dtype)
    place = torch.device(rank_placement(world_size)[0])
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)
    completions = [[] for _ in range(world_size)]
    losses = [[] for _ in range(world_size)]
    with original_functional_linear():
        master = PolicyModel(job.model).to(place)
        work = copy.deepcopy(master).to(dtype)
        with torch.no_grad():  # DeepSpeed casts the model first and makes its fp32 master from that copy
            for param, copy_ in zip(master.parameters(), work.parameters()):
                param.copy_(copy_.float())
        optimizer = make_optimizer(job, master.parameters())
        for step in range(job.steps):
            for rank in range(world_size):
                prompts = batches.micro(step, 0, rank)[0].to(place, dtype)
                completions[rank].append(work.generate(prompts).float().cpu().numpy())
            optimizer.zero_grad()
            shards = []
            for rank in range(world_size):
                prompts, targets = batches.micro(step, 0, rank)
                loss = mse(work(prompts.to(place, dtype)), targets.to(place))
                shards.append(torch.autograd.grad(loss, list(work.parameters())))
                losses[rank].append(loss.item())
            for index, param in enumerate(master.parameters()):
                if dtype == torch.float32:
                    for grads in shards:
                        param.grad = grads[index].float() / world_size + (param.grad if param.grad is not None else 0)
                else:  # the all-reduce's sum in the model's dtype, in rank order, then the average, then fp32
                    total = shards[0][index]
                    for grads in shards[1:]:
                        total = total + grads[index]
                    param.grad = (total * (1.0 / world_size)).float()
            optimizer.step()
            with torch.no_grad():
                for param, copy_ in zip(master.parameters(), work.parameters()):
                    copy_.copy_(param)
        params = {name: p.detach().float().cpu().numpy().copy() for name, p in work.named_parameters()}
    return Reference(np.array(completions), np.array(losses), params)


@dataclass
class Outcome:
    """The user's script on the launched ranks, next to plain PyTorch. ``error``: the first failing rank's."""

    dtype: str
    world_size: int
    error: RankFailedError | None = None
    completions: np.ndarray | None = None  # [rank, step, batch, new_tokens, features]
    losses: np.ndarray | None = None  # [rank, step]
    params: dict[str, np.ndarray] = field(default_factory=dict)  # rank 0's, gathered
    reference: Reference | None = None

    @property
    def error_line(self) -> str:
        return "" if self.error is None else f"{self.error.exc_type}: {self.error.message}".splitlines()[0]

    @property
    def bug_error(self) -> bool:
        """The run failed with this bug's error, raised where this bug raises it."""
        return (self.error is not None and (self.error.exc_type, self.error.message.strip()) == ERROR
                and RAISED_IN in self.error.traceback)

    def pairs(self, completions: bool = True) -> list[tuple[str, Any, Any]]:
        """(name, DeepSpeed's, plain PyTorch's): the losses, the weights and (``completions``) what was generated."""
        found = [(f"{self.dtype}: losses per rank and step", self.losses, self.reference.losses),
                 (f"{self.dtype}: weights after training", self.params, self.reference.params)]
        if completions:
            found.append((f"{self.dtype}: generated outputs per rank and step", self.completions,
                          self.reference.completions))
        return found

    def comparisons(self, completions: bool = True) -> list[Any]:
        """:meth:`pairs`, each compared under the dtype's tolerance."""
        from ...harness import compare

        return [compare(actual, expected, self.dtype, name) for name, actual, expected in self.pairs(completions)]

    def trains_like_pytorch(self, completions: bool = True) -> bool:
        return self.error is None and all(c.close for c in self.comparisons(completions))


def run(job: Any, world_size: int = WORLD_SIZE, timeout: float = 240.0) -> Outcome:
    """:func:`user_script` on ``world_size`` fresh ranks (every fix applied here is applied there first), and
    :func:`plain_reference`. A failed run keeps the first failing rank's error."""
    from ...harness import launch

    outcome = Outcome(job.dtype, world_size, reference=plain_reference(job, world_size))
    try:
        ranks = launch(user_script, world_size, job, timeout=timeout)
    except RankFailedError as exc:
        outcome.error = exc
        return outcome
    outcome.completions = np.stack([r["completions"] for r in ranks])
    outcome.losses = np.stack([r["losses"] for r in ranks])
    outcome.params = ranks[0]["params"]
    return outcome


def trace_facts(job: Any) -> dict[str, Any]:
    """One rank (for :func:`fixes.harness.launch`): the user's script up to the crash, reading ZeRO-3's state on the
    way: each module's ``ds_id`` and the coordinator's trace mode after ``deepspeed.initialize``, after the first
    training step and after the second generation (``unwrap_for_generation`` exited: the hooks registered again),
    and the ``ds_id`` keys of the fetch steps the coordinator recorded (``__step_id_module_fetched_for``)."""
    import deepspeed

    from ...harness import device, ds_config, make_batches, mse
    from ...harness.compare import dtype_of

    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    dtype = dtype_of(job.dtype)
    model = PolicyModel(job.model)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=job.lr),
                                           config=ds_config(job, world_size))
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    batches = make_batches(job.model, job.steps, 1, world_size, job.micro_batch, job.data_seed)

    def state(moment: str) -> dict[str, Any]:
        mode = ("COMPLETE" if coordinator.is_complete_trace() else "RECORD" if coordinator.is_record_trace()
                else "INVALID")
        recorded = getattr(coordinator, "_PartitionedParameterCoordinator__step_id_module_fetched_for")
        return {"moment": moment, "ds_id per module": {name or "(outer)": m.ds_id for name, m in
                                                       engine.module.named_modules()},
                "trace": mode, "fetch steps recorded for ds_ids": sorted(k for k, v in recorded.items() if v)}

    states = [state("after deepspeed.initialize")]
    for step in range(2):
        prompts, targets = batches.micro(step, 0, rank)
        prompts = prompts.to(device(), dtype)
        with unwrap_for_generation(engine) as unwrapped:
            unwrapped.generate(prompts)
        states.append(state(f"step {step}: after generation"))
        if step == 1:
            break
        loss = mse(engine(prompts), targets.to(device()))
        engine.backward(loss)
        engine.step()
        states.append(state(f"step {step}: after training"))
    return {"states": states}


__all__ = ["ERROR", "NEW_TOKENS", "Outcome", "PolicyModel", "Reference", "WORLD_SIZE", "job", "plain_reference",
           "run", "trace_facts", "unwrap_for_generation", "user_script"]
