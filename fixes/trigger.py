"""Which jobs hit a bug: each entry's trigger as code, over the job as DeepSpeed resolves it.

A release that has a bug hits only the jobs configured a certain way: bf16 with fp32 gradient accumulation and
ZeRO-1 on two or more ranks; ZeRO-2 with CPU offload and several backward calls per step. An entry states that once,
in ``fixes/entries/<id>/trigger.py``: ``TRIGGER = Trigger(...)``, every :class:`Condition` of which must hold. A
condition reads a :class:`Job`: the DeepSpeed config as the engine resolves it, the world size, the accelerator,
torch, and what the job does that a config cannot show (:data:`USES`, stated by the user or read from a live engine).

A condition answers True, False, or None where the job leaves it open (an ``"auto"`` value a Hugging Face Trainer
fills in later, a use nobody stated). :meth:`Trigger.evaluate` then says *triggered*, *not triggered* (and which
condition is false), or *triggered if* the open conditions hold.

The trigger is measured, not typed: each entry's reproduction defines a grid of jobs around it (``trigger_cells()``
in its ``reproduce.py``), each condition flipped on its own, and ``python -m ci.sweep.triggers`` records on the entry's
reproduce release where the bug shows; a test holds every trigger to its grid. Stdlib only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping

from .batch import from_config as batch_sizes

# What a job does that its DeepSpeed config cannot show: the words ``fixbook doctor --uses`` takes.
USES: dict[str, str] = {
    "direct-backward": "calls loss.backward() (or out.backward(grad)) on the engine's output instead of engine.backward(loss)",
    "several-backward": "calls engine.backward() more than once per optimizer step with gradient_accumulation_steps 1 "
                        "(the accumulation boundary set by hand)",
    "no-sync": "wraps the micro-batches before the boundary in engine.no_sync() (accelerate's accumulate(), the "
               "Hugging Face Trainer)",
    "torch-func": "runs torch.func transforms (grad, grad_and_value, vmap, jacrev) over the model",
    "pipeline": "trains a PipelineModule with PipelineEngine.train_batch",
    "moe-top-k": "has a DeepSpeed MoE layer with top-k gating, k > 2",
    "ulysses-sequence-first": "calls DistributedAttention with batch_dim_idx=1 (the sequence-first layout)",
    "tiled-compute-batch": "runs a module through ALST's tiled compute (TiledMLP.apply or sequence_tiled_compute) on "
                           "micro-batches of more than one sequence (train_micro_batch_size_per_gpu > 1)",
    "param-groups": "gives the optimizer more than one parameter group (the Hugging Face Trainer's weight-decay split)",
    "param-group-lrs": "gives its parameter groups different learning rates",
    "checkpoint-resume": "saves with engine.save_checkpoint and resumes with engine.load_checkpoint",
    "zero-to-fp32": "converts ZeRO checkpoints with zero_to_fp32 / convert_zero_checkpoint_to_fp32_state_dict",
    "ds-to-universal": "converts checkpoints to universal ones with ds_to_universal",
    "optimizer-without-adam-state": "trains with an optimizer that keeps no Adam state (exp_avg, exp_avg_sq): torch's "
                                    "SGD, Muon, Lion, Adafactor...",
    "gathered-parameters": "reads or writes several parameters inside one deepspeed.zero.GatheredParameters",
    "gathered-edit": "edits parameters inside deepspeed.zero.GatheredParameters without modifier_rank (loads a state "
                     "dict, rescales or re-initialises weights there)",
    "pretrained-load": "loads pretrained weights into a ZeRO-3 model (from_pretrained under zero.Init, "
                       "GatheredParameters with modifier_rank)",
    "getattr-wrapper": "wraps submodules in a module whose __getattr__ forwards to the wrapped one (PEFT's "
                       "modules_to_save)",
    "several-sub-groups": "has more parameters per rank than zero_optimization.sub_group_size (1e9 by default)",
    "zero-init": "builds the model inside deepspeed.zero.Init (transformers does under ZeRO-3)",
    "cuda-arch-variant": "builds DeepSpeed's CUDA ops with TORCH_CUDA_ARCH_LIST naming an architecture variant (9.0a, "
                         "10.0a, 12.0a): FusedAdam at run time, or DS_BUILD_OPS / DS_BUILD_FUSED_ADAM at install",
    "hooks-reregistered": "removes and adds ZeRO-3's hooks between training steps (unwrap_model_for_generation, TRL's "
                          "remove_hooks/add_hooks around generation)",
    "openmpi-launch": "launches with `deepspeed --launcher openmpi` (the OpenMPI runner, mpirun)",
    "mpi-launch": "launches over several nodes with an MPI launcher (`deepspeed --launcher openmpi`, `mpich`, `impi` or "
                  "`mvapich`), which passes the exported environment variables on mpirun's command line",
    "init-inference-moe-bool": "calls deepspeed.init_inference with moe=True or moe=False (a bool, the older form of "
                               "the moe setting)",
    "muon-frozen-params": "trains with DeepSpeed's Muon optimizer a model some of whose parameters are frozen "
                          "(requires_grad=False)",
    "activation-checkpointing-frozen": "runs non-reentrant activation checkpointing (torch.utils.checkpoint with "
                                       "use_reentrant=False) over layers some of whose parameters are frozen",
    "torch-optimizer": "passes an optimizer it built itself from torch.optim (Adam, AdamW, SGD) to "
                       "deepspeed.initialize(optimizer=...)",
    "autotp-tp-plan": "shards a Hugging Face model by its tp_plan with AutoTP (tensor_parallel.autotp_size) and "
                      "saves checkpoints for universal conversion",
    "scale-wrt-gas-false": "calls engine.backward(loss, scale_wrt_gas=False) to scale the loss for gradient "
                           "accumulation itself (or not at all)",
    "set-start-method": "calls multiprocessing.set_start_method() (or torch.multiprocessing's) after importing deepspeed",
}
PRECISIONS = ("fp32", "fp16", "bf16")
UNSET = "unset"  # a config key the job leaves to DeepSpeed's default


@dataclass(frozen=True)
class Job:
    """What a trigger reads of a training job. ``None``: not known (an ``"auto"`` value, nothing stated)."""

    zero_stage: int | None = 0
    precision: str | None = "fp32"
    grad_accum_dtype: str | None = UNSET  # data_types.grad_accum_dtype
    gradient_accumulation_steps: int | None = 1
    offload_optimizer: bool | None = False
    contiguous_gradients: bool | None = True
    gradient_clipping: float | str | None = UNSET
    scheduler: str | None = UNSET  # the scheduler's "type"
    warmup_max_lr: float | str | None = UNSET  # the scheduler's params.warmup_max_lr
    all_reduce_fetch_params: bool | None = False  # zero_optimization.stage3_use_all_reduce_for_fetch_params
    hpz_partition_size: int | None = 1
    load_universal: bool | None = False
    communication_data_type: str | None = UNSET  # "communication_data_type": the model's dtype where unset
    autotp_size: int | None = 1  # tensor_parallel.autotp_size: 1 (no AutoTP) where unset
    elasticity: bool | None = False  # elasticity.enabled
    elastic_max_train_batch: int | None = None  # elasticity.max_train_batch_size
    elastic_micro_batches: tuple[int, ...] = ()  # elasticity.micro_batch_sizes
    autotuning: bool | None = False  # autotuning.enabled
    world_size: int | None = None
    accelerator: str | None = None
    torch: str | None = None
    uses: frozenset[str] = frozenset()
    known_uses: frozenset[str] | None = None  # uses whose presence is known; None: all (the user stated them)
    unresolved: tuple[str, ...] = ()  # the config keys that held "auto" or could not be read

    def __post_init__(self) -> None:
        unknown = sorted(set(self.uses) - set(USES))
        if unknown:
            raise ValueError(f"unknown use(s) {', '.join(unknown)}; known: {', '.join(USES)}")

    def uses_(self, name: str) -> bool | None:
        if name in self.uses:
            return True
        return False if self.known_uses is None or name in self.known_uses else None

    def with_(self, **changes: Any) -> "Job":
        return replace(self, **changes)

    def describe(self) -> dict[str, Any]:
        """The job as plain values (for a record or a page)."""
        return {key: (sorted(value) if isinstance(value, frozenset) else value)
                for key, value in self.__dict__.items() if value not in (None, (), frozenset())}


AUTO = "auto"


def _read(config: Mapping[str, Any], path: str, default: Any, unresolved: list[str]) -> Any:
    """``config``'s value at the dotted ``path``; ``default`` where it is absent; None (and the path noted) where
    it is ``"auto"``."""
    value: Any = config
    for key in path.split("."):
        if not isinstance(value, Mapping) or key not in value:
            return default
        value = value[key]
    if isinstance(value, str) and value.strip().lower() == AUTO:
        unresolved.append(path)
        return None
    return value


def _precision(config: Mapping[str, Any], unresolved: list[str]) -> str | None:
    for name in ("bf16", "bfloat16"):
        enabled = _read(config, f"{name}.enabled", False, unresolved)
        if enabled is None:
            return None
        if enabled:
            return "bf16"
    enabled = _read(config, "fp16.enabled", False, unresolved)
    return None if enabled is None else ("fp16" if enabled else "fp32")


def job_from_config(config: Mapping[str, Any], world_size: int | None = None, uses: Iterable[str] | None = None,
                    accelerator: str | None = None, torch: str | None = None) -> Job:
    """The job a DeepSpeed config describes, as DeepSpeed would resolve it (the batch sizes by
    :func:`fixes.batch.resolve`: ``gradient_accumulation_steps`` is None where the data-parallel size it depends on is
    not given or DeepSpeed rejects the combination). ``uses``: what the job does that the
    config cannot show (:data:`USES`), ``None`` if not stated (conditions on uses stay open)."""
    unresolved: list[str] = []
    stage = _read(config, "zero_optimization.stage", 0, unresolved)
    sizes = batch_sizes(config, world_size)
    unresolved += [key for key in sizes.auto if key not in unresolved]
    gas = sizes.gas  # None where DeepSpeed rejects the combination: judged on nothing that cannot exist
    if sizes.incomplete:  # neither batch size given: the launcher (accelerate, a trainer) adds them, or DeepSpeed stops
        gas = config.get("gradient_accumulation_steps") if isinstance(config.get("gradient_accumulation_steps"), int) else None
        if gas is None and "gradient_accumulation_steps" not in unresolved:
            unresolved.append("gradient_accumulation_steps")
    offload = _read(config, "zero_optimization.offload_optimizer.device", "none", unresolved)
    legacy = _read(config, "zero_optimization.cpu_offload", False, unresolved)
    clipping = _read(config, "gradient_clipping", UNSET, unresolved)
    return Job(
        zero_stage=None if stage is None else int(stage),
        precision=_precision(config, unresolved),
        grad_accum_dtype=_read(config, "data_types.grad_accum_dtype", UNSET, unresolved),
        gradient_accumulation_steps=None if gas is None else int(gas),
        offload_optimizer=None if offload is None or legacy is None else (str(offload).lower() in ("cpu", "nvme") or bool(legacy)),
        contiguous_gradients=_read(config, "zero_optimization.contiguous_gradients", True, unresolved),
        gradient_clipping=clipping,
        scheduler=_read(config, "scheduler.type", UNSET, unresolved),
        warmup_max_lr=_read(config, "scheduler.params.warmup_max_lr", UNSET, unresolved),
        all_reduce_fetch_params=_read(config, "zero_optimization.stage3_use_all_reduce_for_fetch_params", False, unresolved),
        hpz_partition_size=_read(config, "zero_optimization.zero_hpz_partition_size", 1, unresolved),
        load_universal=_read(config, "checkpoint.load_universal", False, unresolved),
        communication_data_type=_read(config, "communication_data_type", UNSET, unresolved),
        autotp_size=_read(config, "tensor_parallel.autotp_size", 1, unresolved),
        elasticity=_read(config, "elasticity.enabled", False, unresolved),
        elastic_max_train_batch=_read(config, "elasticity.max_train_batch_size", None, unresolved),
        elastic_micro_batches=tuple(_read(config, "elasticity.micro_batch_sizes", None, unresolved) or ()),
        autotuning=_read(config, "autotuning.enabled", False, unresolved),
        world_size=world_size, accelerator=accelerator, torch=torch,
        uses=frozenset(uses or ()), known_uses=None if uses is not None else frozenset(),
        unresolved=tuple(unresolved))


# ---- conditions ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Condition:
    """One thing a trigger needs of a job: ``test`` answers True, False or None (the job leaves it open)."""

    label: str  # as a user reads it: "ZeRO stage 1 or 2"
    test: Callable[[Job], bool | None] = field(compare=False, repr=False)
    key: str = ""  # the Job field or use it reads (a cell of the grid flips it)

    def __call__(self, job: Job) -> bool | None:
        return self.test(job)


def _known(value: Any, check: Callable[[Any], bool]) -> bool | None:
    return None if value is None else bool(check(value))


def stage(*stages: int) -> Condition:
    names = " or ".join(map(str, stages))
    return Condition(f"ZeRO stage {names}", lambda job: _known(job.zero_stage, lambda v: v in stages), "zero_stage")


def precision(*kinds: str) -> Condition:
    return Condition(" or ".join(kinds), lambda job: _known(job.precision, lambda v: v in kinds), "precision")


def grad_accum_dtype(value: str, equal: bool = True) -> Condition:
    label = f"data_types.grad_accum_dtype {'=' if equal else '!='} {value}"
    return Condition(label, lambda job: _known(job.grad_accum_dtype, lambda v: (v == value) == equal), "grad_accum_dtype")


def gas(at_least: int | None = None, equals: int | None = None) -> Condition:
    if equals is not None:
        return Condition(f"gradient_accumulation_steps = {equals}",
                         lambda job: _known(job.gradient_accumulation_steps, lambda v: v == equals),
                         "gradient_accumulation_steps")
    assert at_least is not None
    return Condition(f"gradient_accumulation_steps >= {at_least}",
                     lambda job: _known(job.gradient_accumulation_steps, lambda v: v >= at_least),
                     "gradient_accumulation_steps")


def offload_optimizer(on: bool = True) -> Condition:
    return Condition("offload_optimizer to CPU" if on else "no optimizer offload",
                     lambda job: _known(job.offload_optimizer, lambda v: v == on), "offload_optimizer")


def contiguous_gradients(on: bool) -> Condition:
    return Condition(f"contiguous_gradients: {str(on).lower()}",
                     lambda job: _known(job.contiguous_gradients, lambda v: bool(v) == on), "contiguous_gradients")


def world_size(at_least: int) -> Condition:
    return Condition(f"{at_least} or more data-parallel ranks",
                     lambda job: _known(job.world_size, lambda v: v >= at_least), "world_size")


def accelerator(name: str) -> Condition:
    return Condition(f"the {name.upper()} accelerator", lambda job: _known(job.accelerator, lambda v: v == name),
                     "accelerator")


def torch_below(version: str) -> Condition:
    def older(value: str) -> bool:
        return _version(value) < _version(version)
    return Condition(f"torch < {version}", lambda job: _known(job.torch, older), "torch")


def uses(name: str) -> Condition:
    if name not in USES:
        raise ValueError(f"unknown use {name!r}; known: {', '.join(USES)}")
    return Condition(f"the job {USES[name]}", lambda job: job.uses_(name), f"uses:{name}")


def unset(key: str, label: str) -> Condition:
    """The config leaves ``key`` (a :class:`Job` field) to DeepSpeed's default."""
    return Condition(label, lambda job: _known(getattr(job, key), lambda v: v == UNSET), key)


def equals(key: str, value: Any, label: str) -> Condition:
    return Condition(label, lambda job: _known(getattr(job, key), lambda v: v == value), key)


def above(key: str, value: float, label: str) -> Condition:
    return Condition(label, lambda job: _known(getattr(job, key), lambda v: v not in (UNSET,) and float(v) > value), key)


def any_of(*conditions: Condition) -> Condition:
    """One of ``conditions`` holds: True if any does, False if none can, None otherwise."""
    def test(job: Job) -> bool | None:
        answers = [condition(job) for condition in conditions]
        return True if True in answers else (None if None in answers else False)
    return Condition(" or ".join(f"({c.label})" if " or " in c.label else c.label for c in conditions), test,
                     "|".join(c.key for c in conditions))


def _version(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


# ---- the trigger -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verdict:
    """``triggered``: True, False, or None (it depends on ``open``, the conditions the job leaves open)."""

    triggered: bool | None
    false: tuple[str, ...] = ()  # the conditions the job does not meet
    open: tuple[str, ...] = ()  # the conditions the job leaves open
    unresolved: tuple[str, ...] = ()  # the job's config keys that held "auto"

    @property
    def why(self) -> str:
        if self.triggered:
            return "this job meets every condition"
        if self.triggered is False:
            return "not: " + "; ".join(self.false)
        return "if: " + "; ".join(self.open)


@dataclass(frozen=True)
class Trigger:
    """Every condition must hold for a job to hit the bug. ``note``: what the conditions leave out, in a line."""

    conditions: tuple[Condition, ...]
    note: str = ""

    def __init__(self, *conditions: Condition, note: str = "") -> None:
        object.__setattr__(self, "conditions", tuple(conditions))
        object.__setattr__(self, "note", note)

    def evaluate(self, job: Job) -> Verdict:
        answers = [(condition, condition(job)) for condition in self.conditions]
        false = tuple(c.label for c, answer in answers if answer is False)
        open_ = tuple(c.label for c, answer in answers if answer is None)
        triggered = False if false else (None if open_ else True)
        return Verdict(triggered, false, open_, job.unresolved)

    @property
    def labels(self) -> list[str]:
        return [condition.label for condition in self.conditions]

    def text(self) -> str:
        return " and ".join(self.labels) + (f" ({self.note})" if self.note else "")


# ---- the measured grids ----------------------------------------------------------------------------------------

GRIDS = __import__("pathlib").Path(__file__).resolve().parent / "data" / "triggers.json"


def job_to_record(job: Job) -> dict[str, Any]:
    return {key: (sorted(value) if isinstance(value, frozenset) else list(value) if isinstance(value, tuple) else value)
            for key, value in job.__dict__.items()}


def job_from_record(data: Mapping[str, Any]) -> Job:
    values = dict(data)
    values["uses"] = frozenset(values.get("uses") or ())
    values["known_uses"] = None if values.get("known_uses") is None else frozenset(values["known_uses"])
    values["unresolved"] = tuple(values.get("unresolved") or ())
    values["elastic_micro_batches"] = tuple(values.get("elastic_micro_batches") or ())
    return Job(**values)


@dataclass(frozen=True)
class GridCell:
    """A recorded cell of a trigger grid, with what the trigger says of its job now."""

    label: str
    flips: str
    job: Job
    reproduced: bool | None  # None: the run could not tell (``error`` says why)
    predicted: bool | None
    error: str = ""

    @property
    def agrees(self) -> bool | None:
        """Whether the trigger and the measurement agree; None where the cell could not be measured here."""
        return None if self.reproduced is None else self.predicted == self.reproduced


@dataclass(frozen=True)
class Grid:
    entry: str
    release: str
    date: str
    code: str  # the entry's code it was measured with (``ci.sweep.triggers``' hash)
    cells: tuple[GridCell, ...]

    @property
    def disagreements(self) -> list[str]:
        return [f"{cell.label}: the trigger says {'triggered' if cell.predicted else 'not triggered' if cell.predicted is False else 'open'}, "
                f"the run {'reproduced' if cell.reproduced else 'did not reproduce'} the bug"
                for cell in self.cells if cell.agrees is False]


def recorded_grid(entry_id: str, trigger: Trigger | None, path: Any = None) -> Grid | None:
    """The entry's measured grid (``fixes/data/triggers.json``, written by ``python -m ci.sweep.triggers``), each cell with
    what ``trigger`` predicts for it; None before the first measurement."""
    import json
    from pathlib import Path

    record = Path(path or GRIDS)
    data = json.loads(record.read_text()).get("entries", {}).get(entry_id) if record.exists() else None
    if not data:
        return None
    cells = []
    for cell in data["cells"]:
        job = job_from_record(cell["job"])
        predicted = trigger.evaluate(job).triggered if trigger is not None else None
        cells.append(GridCell(cell["label"], cell.get("flips", ""), job, cell["reproduced"], predicted, cell.get("error", "")))
    return Grid(entry_id, data["release"], data["date"], data["code"], tuple(cells))
