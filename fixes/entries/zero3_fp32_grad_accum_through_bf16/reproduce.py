"""How zero3-fp32-grad-accum-through-bf16 is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or
its probe.

``user_script()`` is one rank of a user's training script (what the ``deepspeed`` launcher starts on each rank);
``reference_fp32_grads()`` is the fp32 gradient plain-PyTorch data parallelism with fp32 gradient accumulation
steps on.
"""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

WORLD_SIZE = 2
FIX_ID = "zero3-fp32-grad-accum-through-bf16"
OPTIMIZER = "DeepSpeedZeroOptimizer_Stage3"
# What the user asks for: bf16 training, gradients reduced and accumulated in fp32.
FP32_GRADIENTS = {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}
# ZeRO-3's two reductions and the gradients they get (zero_optimization keys over {"stage": 3}):
# __avg_scatter_grads on the gradients moved into ZeRO-3's contiguous bucket (the default, reduce_scatter true),
# __avg_scatter_contiguous_grads on that bucket (reduce_scatter false), __avg_scatter_grads on each parameter's own
# bf16 .grad (contiguous_gradients false).
PATHS = {
    "reduce_scatter (default)": {},
    "reduce_scatter false": {"reduce_scatter": False},
    "contiguous_gradients false": {"contiguous_gradients": False},
}


def model_spec() -> Any:
    """TinyMLP 8 -> 15 -> 3: two of its four tensors (the biases) have an odd size, so ZeRO-3 pads one rank's
    partition of them, as it pads most parameters of a real model on some rank."""
    from ...harness import ModelSpec

    return ModelSpec(in_features=8, hidden=15, out_features=3)


def zero3_job(path: str = "reduce_scatter (default)", **changes: Any) -> Any:
    """The harness job of this entry: bf16 under ZeRO stage 3 with ``data_types.grad_accum_dtype: fp32`` and
    ``communication_data_type: fp32``, four micro-batches per step, SGD (lr 0.1), on :func:`model_spec`'s model;
    ``path`` one of :data:`PATHS`."""
    from ...harness import Job

    config: dict[str, Any] = dict(FP32_GRADIENTS)
    if PATHS[path]:
        config["zero_optimization"] = {"stage": 3, **PATHS[path]}
    return Job(zero_stage=3, dtype="bfloat16", micro_steps=4, steps=2, model=model_spec(),
               config=config).with_(**changes)


def user_script(job: Any) -> dict[str, Any]:
    """One rank: ``deepspeed.initialize`` with the job's config, then ``engine(x)``, ``engine.backward(loss)``,
    ``engine.step()`` on this rank's shard of every micro-batch. After the last micro-batch's backward of each step,
    just before ``engine.step()``, it reads the full fp32 gradient the optimizer is about to step on with
    ``deepspeed.utils.safe_get_full_grad`` (a collective: every rank calls it). Returns the optimizer's class name,
    those gradients per step (by parameter name), the global gradient norm per step and the trained parameters
    (fp32)."""
    import torch
    from deepspeed.utils import safe_get_full_grad

    from ...harness import build_engine, device, gathered_params, make_batches, mse
    from ...harness.compare import dtype_of

    engine = build_engine(job)  # deepspeed.initialize(model=TinyMLP(), optimizer=SGD, config=ds_config(job))
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    dtype = dtype_of(job.dtype)
    batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
    fp32_grads: list[dict[str, Any]] = []
    norms: list[float | None] = []
    for step in range(job.steps):
        for micro in range(job.micro_steps):
            x, y = batches.micro(step, micro, rank)
            loss = mse(engine(x.to(device(), dtype)), y.to(device()))
            engine.backward(loss)
            if micro == job.micro_steps - 1:  # what the optimizer is about to step on
                fp32_grads.append({name: safe_get_full_grad(param).detach().float().cpu().numpy().copy()
                                   for name, param in engine.module.named_parameters()})
            engine.step()
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return {"optimizer": type(engine.optimizer).__name__, "fp32_grads": fp32_grads, "grad_norms": norms,
            "params": gathered_params(engine.module)}


def reference_fp32_grads(job: Any, world_size: int = WORLD_SIZE, rounded_to: Any = None) -> dict[str, Any]:
    """Plain PyTorch, the first step's gradient of data parallelism on ``world_size`` shards with fp32 gradient
    accumulation, by parameter name: the model held in the job's dtype, each micro-loss divided by gas, each
    micro-batch's shard gradients converted to fp32 and averaged over the shards in fp32, the averages summed in
    fp32 (the arithmetic of :func:`fixes.harness.train_reference`, whose trained weights the notebook compares, up
    to the order of the fp32 additions). With ``rounded_to=torch.bfloat16``: the bug's arithmetic, each
    micro-batch's fp32 average rounded to bf16 before it is added to the fp32 sum."""
    import torch

    from ...harness import TinyMLP, make_batches, mse
    from ...harness.compare import dtype_of
    from ...harness.env import rank_placement
    from ...harness.training import original_functional_linear

    dtype = dtype_of(job.dtype)
    place = torch.device(rank_placement(world_size)[0])  # where the ranks run, so that both sides round alike
    batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
    with original_functional_linear():
        work = TinyMLP(job.model).to(place, dtype)
        names = [name for name, _ in work.named_parameters()]
        total = {name: torch.zeros_like(param, dtype=torch.float32) for name, param in work.named_parameters()}
        for micro in range(job.micro_steps):
            average = {name: torch.zeros_like(grad) for name, grad in total.items()}
            for rank in range(world_size):
                x, y = batches.micro(0, micro, rank)
                loss = mse(work(x.to(place, dtype)), y.to(place)) / job.micro_steps
                for name, grad in zip(names, torch.autograd.grad(loss, list(work.parameters()))):
                    average[name] += grad.float() / world_size
            for name, grad in average.items():
                total[name] += grad if rounded_to is None else grad.to(rounded_to).float()
    return {name: grad.cpu().numpy() for name, grad in total.items()}


def run_ranks(job: Any, world_size: int = WORLD_SIZE, timeout: float = 180.0) -> list[dict[str, Any]]:
    """``user_script(job)`` on ``world_size`` gloo ranks, each with its own shard of the data; raises
    CannotTellError where the engine did not build ZeRO-3's optimizer (the bug lives there)."""
    from ...harness import launch

    ranks = launch(user_script, world_size, job, timeout=timeout)
    optimizers = {rank["optimizer"] for rank in ranks}
    if optimizers != {OPTIMIZER}:
        raise CannotTellError(f"the job built {', '.join(sorted(optimizers))}, not {OPTIMIZER}")
    return ranks


def rounding_shown(job: Any, ranks: list[dict[str, Any]]) -> bool:
    """Whether the ranks' first-step fp32 gradients (:func:`user_script`) are the bug's: False where every rank's is
    plain PyTorch's fp32 average (:func:`reference_fp32_grads`) within the job's dtype tolerance, True where they
    are the bf16-rounded averages (``rounded_to=bfloat16``) instead; CannotTellError where a rank's is neither (a
    fault this entry's arithmetic does not explain)."""
    import torch

    from ...harness import compare

    expected = reference_fp32_grads(job)
    rounded = reference_fp32_grads(job, rounded_to=torch.bfloat16)
    shown = False
    for rank, result in enumerate(ranks):
        grads = result["fp32_grads"][0]
        if compare(grads, expected, job.dtype).close:
            continue
        versus = compare(grads, rounded, job.dtype)
        if not versus.close:
            plain = compare(grads, expected, job.dtype)
            raise CannotTellError(f"rank {rank}'s gradient is neither plain PyTorch's fp32 average (max abs diff "
                                  f"{plain.max_abs_diff:.1e}) nor the bf16-rounded one ({versus.max_abs_diff:.1e}), "
                                  f"beyond the {job.dtype} tolerance: another fault")
        shown = True
    return shown


def reproduce(paths: tuple[str, ...] = tuple(PATHS)) -> bool:
    """Two ranks, bf16 ZeRO-3 with fp32 gradient accumulation and fp32 communication, gas=4, one step, on each
    reduction path (:data:`PATHS`) in turn: True as soon as one path steps on the bf16-rounded averages instead of
    plain-PyTorch data parallelism's fp32 average (:func:`rounding_shown`), False where every path steps on the fp32
    average; CannotTellError where a path gives neither (and none showed the rounding before it)."""
    for path in paths:
        job = zero3_job(path, steps=1)
        try:
            if rounding_shown(job, run_ranks(job)):
                return True
        except CannotTellError as exc:
            raise CannotTellError(f"{path}: {exc}") from None
    return False


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def first_step_grads(job: Any, world_size: int = WORLD_SIZE) -> list[dict[str, Any]]:
    """One rank of :func:`user_script` per rank, any optimizer: each rank's first-step gradient."""
    from ...harness import launch

    return [rank["fp32_grads"][0] for rank in launch(user_script, world_size, job, timeout=180.0)]


def rounding_shows(job: Any, world_size: int = WORLD_SIZE) -> bool:
    """``job``'s first step on ``world_size`` ranks, as it is and with this entry's fix in the ranks: True if the
    fp32 gradient either rank steps on differs between the two beyond the job's dtype tolerance, i.e. if casting
    the reduced gradients to the model dtype instead of ``grad_accum_dtype`` (the only thing the fix changes)
    shows in the gradient."""
    from ...harness import compare

    as_is = first_step_grads(job, world_size)
    fixed = first_step_grads(job.with_(fixes=(FIX_ID,)), world_size)
    return any(not compare(got, want, job.dtype).close for got, want in zip(as_is, fixed))


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): bf16 with ``grad_accum_dtype`` and ``communication_data_type``
    fp32 under ZeRO-3 on two ranks, gas 4, one SGD step, on each reduction path of :data:`PATHS` (the sweep's jobs)
    and with ``offload_optimizer`` to CPU, then each condition flipped on its own: gas 1, fp32, bf16 gradient
    accumulation (the default), ZeRO-2, one rank.

    Each cell compares the first step's fp32 gradient with and without this entry's fix applied in the ranks
    (:func:`rounding_shows`), not with plain PyTorch: the flipped jobs differ from fp32 data parallelism for
    reasons that are no bug (bf16 accumulation rounds the sums; ZeRO-2 accumulates differently), and the
    question a cell answers is whether *this* rounding shows. With gas 1 it does, but within the bf16
    tolerance (the average of two bf16 gradients rounded once to bf16); with one rank the cast is exact.

    And ``communication_data_type`` left at its default (bf16 under bf16), where gradients are reduced in bf16 as
    asked, on every release, and the fix changes nothing."""
    from ...harness import Cell, trigger_job

    base = zero3_job(steps=1)

    def cell(label: str, job: Any, world_size: int = WORLD_SIZE, flips: str = "") -> Cell:
        return Cell(label, trigger_job(job, world_size), lambda: rounding_shows(job, world_size), flips)

    return [cell("bf16, grad_accum_dtype and communication_data_type fp32, ZeRO-3, two ranks, gas 4", base),
            cell("the same with reduce_scatter false (the contiguous reduction)",
                 zero3_job("reduce_scatter false", steps=1)),
            cell("the same with contiguous_gradients false", zero3_job("contiguous_gradients false", steps=1)),
            cell("the same with offload_optimizer to CPU", base.with_(offload=True)),
            cell("gas 1", base.with_(micro_steps=1), flips="gradient_accumulation_steps"),
            cell("fp32 instead", base.with_(dtype="float32"), flips="precision"),
            cell("bf16 gradient accumulation (the default)",
                 base.with_(config={"communication_data_type": FP32_GRADIENTS["communication_data_type"]}),
                 flips="grad_accum_dtype"),
            cell("ZeRO-2 instead", base.with_(zero_stage=2), flips="zero_stage"),
            cell("one rank", base, 1, "world_size"),
            cell("communication_data_type left at its default",
                 base.with_(config={"data_types": FP32_GRADIENTS["data_types"]}), flips="communication_data_type")]


def bench_job():
    """The job ``python -m ci.bench`` times with this fix applied (its fix is on the training path)."""
    from ... import harness

    return harness.bench_job(zero_stage=3, dtype="bfloat16", micro_steps=4, config=dict(FP32_GRADIENTS))
