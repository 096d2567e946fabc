"""A differential cell as a standalone script a user can run, read, and file upstream: torch and DeepSpeed only.

:func:`script` writes the cell's DeepSpeed config, its training loop through DeepSpeed (the calls of
:func:`fixes.harness.differential.run_rank`) and the plain-PyTorch reference it is judged against (those of
:func:`~fixes.harness.differential.train_reference_cell` and :func:`~fixes.harness.differential.judge`), with the
cell's values written in as constants. It launches its own ranks (``torch.multiprocessing``, gloo), prints each
step's comparison and a last line ``verdict: ...`` in the differential record's words (``agrees``, ``differs:
QUANTITY``, ``crashes: EXCEPTION``, ``rejected: EXCEPTION``), and exits 1 unless DeepSpeed agrees with PyTorch.
``tests/fixes/harness/test_standalone.py`` checks that the script's verdict is the sweep's on real releases.
"""
from __future__ import annotations

import json
import textwrap
from string import Template
from typing import Any, Mapping

from ..checked import script_name
from ..versions import parse
from .compare import TOLERANCES
from .differential import (CLIP_EPSILON, Settings, ds_config, reduces_every_micro_step, reference_gaps,
                           scheduled_lrs)

TEMPLATE = Template('''\
"""$title

$about

Run it with `python $name`: it starts its own $ranks (gloo). It prints each step's comparison with plain PyTorch
(same initial weights, same data) and a last line `verdict: ...`; it exits 1 unless DeepSpeed agrees within the
tolerance of the precision. Needs torch and deepspeed only.
"""
import contextlib
import datetime
import os
import socket
import sys
import tempfile
import traceback

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # measured on DeepSpeed's CPU accelerator; unset it to use yours
import torch  # noqa: E402

# ---- the configuration -----------------------------------------------------------------------------------------
CONFIG = $config
WORLD_SIZE = $world
STEPS = $steps  # optimizer steps
GAS = $gas  # gradient_accumulation_steps: micro-batches per optimizer step
MICRO_BATCH = $micro
DTYPE = torch.$dtype
LOSS_SCALE = $scale  # fp16's loss scale (static, or the dynamic scale's start, 2**7, which these steps keep); else 1
OPTIMIZER = "$optimizer"  # the torch optimizer handed to deepspeed.initialize
PARAM_GROUPS = $groups  # 2: weights (lr, weight decay) and biases (lr / 2, none), as the Hugging Face Trainer splits
LR, WEIGHT_DECAY = $lr, $weight_decay
ZERO_STAGE = $stage
ZERO_INIT = $zero_init  # build the model inside deepspeed.zero.Init
CHECKPOINT = "$checkpoint"  # save-load / universal: save after half the steps, load into a fresh engine
BACKWARD = "$backward"  # engine: engine.backward(loss); tensor: loss.backward() on the engine's output
GRADIENT_CLIPPING = $clip
GRAD_ACCUM_DTYPE = "$accum"  # data_types.grad_accum_dtype; unset: the release's default (engine.get_data_types())
# PyTorch's side: each group's lr at each step, as DeepSpeed's lr_schedules.py documents the configured scheduler
EXPECTED_LRS = $lrs
# ZeRO-2/3 average each micro-batch's gradients over the ranks as backward makes them and accumulate the averages;
# ZeRO-0/1 accumulate each rank's gradients and average the sums at the step
REDUCE_EACH_MICRO_STEP = $each
RTOL, ATOL = $rtol, $atol  # |deepspeed - pytorch| <= ATOL + RTOL * |pytorch|: this precision's tolerance
IN, HIDDEN, OUT, MODEL_SEED, DATA_SEED = $in_features, $hidden, $out_features, $model_seed, $data_seed


class TinyMLP(torch.nn.Module):
    """Linear(IN, HIDDEN) -> Tanh -> Linear(HIDDEN, OUT), seeded: the same weights wherever it is built."""

    def __init__(self):
        super().__init__()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(MODEL_SEED)
            self.fc1 = torch.nn.Linear(IN, HIDDEN)
            self.act = torch.nn.Tanh()
            self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def batches():
    """Inputs and targets shaped [STEPS, GAS, WORLD_SIZE, MICRO_BATCH, features]: every rank's micro-batches."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    shape = (STEPS, GAS, WORLD_SIZE, MICRO_BATCH)
    return torch.randn(*shape, IN, generator=generator), torch.randn(*shape, OUT, generator=generator)


def mse(output, target):
    return ((output.float() - target.float()) ** 2).mean()


def param_groups(model):
    named = list(model.named_parameters())
    if PARAM_GROUPS == 1:
        return [{"params": [p for _, p in named], "lr": LR, "weight_decay": WEIGHT_DECAY}]
    return [{"params": [p for n, p in named if not n.endswith("bias")], "lr": LR, "weight_decay": WEIGHT_DECAY},
            {"params": [p for n, p in named if n.endswith("bias")], "lr": LR / 2, "weight_decay": 0.0}]


def torch_optimizer(groups):
    return {"torch-adamw": torch.optim.AdamW, "torch-adam": torch.optim.Adam, "torch-sgd": torch.optim.SGD}[OPTIMIZER](groups)


# ---- DeepSpeed -------------------------------------------------------------------------------------------------
def cpu_accelerator_setup():
    """On DeepSpeed's CPU accelerator only (nothing changes on another): let it report fp16 as supported, as CUDA's
    does, and skip init_distributed's JIT build of the shared-memory all-reduce op (gloo's is used instead)."""
    import importlib

    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if type(accelerator).__name__ != "CPU_Accelerator":
        return
    native = type(accelerator).supported_dtypes.__get__(accelerator)
    accelerator.is_fp16_supported = lambda: True
    accelerator.supported_dtypes = lambda: list(native()) + ([] if torch.float16 in native() else [torch.float16])
    comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None


def build(extra=None):
    import deepspeed

    config = {**CONFIG, **(extra or {})}
    if ZERO_INIT:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = TinyMLP()
    else:
        model = TinyMLP()
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch_optimizer(param_groups(model)), config=config)
    return engine


def gathered(module):
    """Every parameter's full value (ZeRO-3: gathered one parameter at a time), as fp32 on the CPU."""
    import deepspeed

    named = dict(module.named_parameters())
    with contextlib.ExitStack() as stack:
        for param in named.values():
            stack.enter_context(deepspeed.zero.GatheredParameters([param]))
        return {name: param.detach().float().cpu().clone() for name, param in named.items()}


def resume(engine, rank, directory):
    """save_checkpoint, (universal: ds_to_universal on rank 0), a fresh engine, load_checkpoint."""
    import torch.distributed as dist

    engine.save_checkpoint(directory, tag="mid")
    dist.barrier()
    extra, tag = {}, "mid"
    if CHECKPOINT == "universal":
        if rank == 0:
            from deepspeed.checkpoint import ds_to_universal

            argv = ["ds_to_universal.py", "--input_folder", os.path.join(directory, "mid"), "--output_folder",
                    os.path.join(directory, "mid_universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"]
            argv += ["--inject_missing_state"] if ZERO_STAGE in (1, 2) else []
            saved, sys.argv = sys.argv, argv
            try:
                ds_to_universal.main(ds_to_universal.parse_arguments())
            finally:
                sys.argv = saved
        dist.barrier()
        extra, tag = {"checkpoint": {"load_universal": True}}, "mid_universal"
    fresh = build(extra)
    path, _ = fresh.load_checkpoint(directory, tag=tag)
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {directory}")
    return fresh


def deepspeed_rank(rank, directory):
    """This rank's run through DeepSpeed: {"status": "ok", "losses", "params", "grad_norms", "lrs", ...} or
    {"status": "rejected" | "crashes", "error", "trace"}."""
    import deepspeed
    import torch.distributed as dist

    cpu_accelerator_setup()
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))
    try:
        engine = build()
    except Exception as exc:  # what initialize raises is its refusal of the configuration
        return {"status": "rejected", "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
    try:
        inputs, targets = batches()
        losses, params, norms, lrs = [], [], [], []
        resume_at = STEPS // 2 if CHECKPOINT in ("save-load", "universal") else None
        for step in range(STEPS):
            if step == resume_at:
                engine = resume(engine, rank, directory)
            place = next(engine.module.parameters()).device
            lrs.append([float(group["lr"]) for group in engine.optimizer.param_groups])
            for micro in range(GAS):
                x, y = inputs[step, micro, rank], targets[step, micro, rank]
                loss = mse(engine(x.to(place, DTYPE)), y.to(place))
                if BACKWARD == "engine":
                    engine.backward(loss)
                elif DTYPE == torch.float16 and hasattr(engine, "scale"):
                    engine.scale(loss).backward()  # fp16's documented direct backward
                else:
                    loss.backward()
                engine.step()
                losses.append(float(loss.item()))
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
            params.append(gathered(engine.module))
        try:
            resolved = str(engine.get_data_types()[1]).replace("torch.", "")
        except Exception:  # a release without get_data_types
            resolved = ""
        result = {"status": "ok", "losses": losses, "params": params, "grad_norms": norms, "lrs": lrs,
                  "resolved": resolved}
        if CHECKPOINT == "zero-to-fp32":
            engine.save_checkpoint(directory, tag="final")
            dist.barrier()
            if rank == 0:
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

                state = get_fp32_state_dict_from_zero_checkpoint(directory, tag="final")
                result["converted"] = {name: value.detach().float().cpu().clone() for name, value in state.items()}
            dist.barrier()
        return result
    except Exception as exc:
        refused = isinstance(exc, NotImplementedError) or "not supported" in str(exc).lower()
        return {"status": "rejected" if refused else "crashes", "error": f"{type(exc).__name__}: {exc}",
                "trace": traceback.format_exc()}


def rank_main(rank, port, directory):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_SIZE=str(WORLD_SIZE),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    result = deepspeed_rank(rank, directory)
    torch.save(result, os.path.join(directory, f"rank{rank}.pt"))
    if result["status"] != "ok":
        print(f"rank {rank}: {result['trace']}", file=sys.stderr, flush=True)
        os._exit(0)  # the other ranks may wait in a collective: its timeout ends them


# ---- plain PyTorch ---------------------------------------------------------------------------------------------
def accumulation_dtype(resolved):
    """The dtype DeepSpeed sums a step's micro-batch gradients in: fp32 where asked (or the model is fp32), else
    the release's resolved default, else the model's dtype."""
    if DTYPE == torch.float32 or GRAD_ACCUM_DTYPE == "fp32":
        return torch.float32
    if GRAD_ACCUM_DTYPE == "unset" and resolved:
        return getattr(torch, resolved)
    return DTYPE


def rank_mean(values):
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total * (1.0 / len(values))


def step_gradients(work, inputs, targets, step, losses, resolved, backward):
    """One step's gradients as DeepSpeed's fp32 master weights receive them: every rank's micro-batch gradients of
    loss * LOSS_SCALE / GAS in the model's dtype, accumulated, averaged over the ranks, unscaled in fp32."""
    accumulate = accumulation_dtype(resolved)
    sums, total = [None] * WORLD_SIZE, None
    for micro in range(GAS):
        micro_grads = []
        for rank in range(WORLD_SIZE):
            output = work(inputs[step, micro, rank].to(DTYPE))
            if backward == "tensor":  # the engine's hook divides the gradient entering its output
                output.register_hook(lambda grad: grad / GAS)
                loss = mse(output, targets[step, micro, rank])
                micro_grads.append(torch.autograd.grad(loss * LOSS_SCALE, list(work.parameters())))
            else:  # engine.backward(loss) divides the loss
                loss = mse(output, targets[step, micro, rank])
                micro_grads.append(torch.autograd.grad(loss * (LOSS_SCALE / GAS), list(work.parameters())))
            if rank == 0:
                losses.append(float(loss.item()))
        if REDUCE_EACH_MICRO_STEP:
            mean = [rank_mean([grads[i] for grads in micro_grads]).to(accumulate) for i in range(len(micro_grads[0]))]
            total = mean if total is None else [a + g for a, g in zip(total, mean)]
        else:
            for rank, grads in enumerate(micro_grads):
                grads = [g.to(accumulate) for g in grads]
                sums[rank] = grads if sums[rank] is None else [a + g for a, g in zip(sums[rank], grads)]
    if not REDUCE_EACH_MICRO_STEP:
        if WORLD_SIZE > 1 and accumulate != DTYPE:  # fp32 sums all-reduced in the model's dtype (communication_data_type)
            sums = [[g.to(DTYPE) for g in grads] for grads in sums]
        total = [rank_mean([sums[rank][i] for rank in range(WORLD_SIZE)]) for i in range(len(sums[0]))]
    return [g.float() / LOSS_SCALE for g in total]


def pytorch_run(resolved, backward=BACKWARD):
    """The same training in plain PyTorch: fp32 master weights, a working copy in the model's dtype."""
    inputs, targets = batches()
    master, work = TinyMLP(), TinyMLP().to(DTYPE)
    with torch.no_grad():  # DeepSpeed casts the model first and makes its fp32 master weights from that copy
        for param, low in zip(master.parameters(), work.parameters()):
            param.copy_(low.float())
    optimizer = torch_optimizer(param_groups(master))
    if ZERO_STAGE == 0 and DTYPE != torch.float32 and accumulation_dtype(resolved) != torch.float32:
        # Without ZeRO, fp16 (and bf16 accumulated in bf16) wrap a torch optimizer in FP16_UnfusedOptimizer, whose
        # constructor steps it once on zero gradients (initialize_optimizer_states): Adam's step count starts one
        # ahead and weight decay moves the master weights once; the model keeps its weights until the first step.
        for param in master.parameters():
            param.grad = torch.zeros_like(param)
        optimizer.step()
        optimizer.zero_grad()
    losses, params, norms = [], [], []
    for step in range(STEPS):
        for group, lr in zip(optimizer.param_groups, EXPECTED_LRS[step]):
            group["lr"] = lr
        grads = step_gradients(work, inputs, targets, step, losses, resolved, backward)
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
        norms.append(norm)
        if GRADIENT_CLIPPING > 0 and GRADIENT_CLIPPING / (norm + $epsilon) < 1:
            grads = [g * (GRADIENT_CLIPPING / (norm + $epsilon)) for g in grads]
        for param, grad in zip(master.parameters(), grads):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for param, low in zip(master.parameters(), work.parameters()):
                low.copy_(param)
        params.append({name: p.detach().float().clone() for name, p in work.named_parameters()})
    master_weights = {name: p.detach().float().clone() for name, p in master.named_parameters()}
    return {"losses": losses, "params": params, "grad_norms": norms, "lrs": EXPECTED_LRS, "master": master_weights}


# ---- the comparison --------------------------------------------------------------------------------------------
def difference(got, want):
    """(largest |got - want|, whether every value is within the tolerance)."""
    if isinstance(got, dict):
        results = [difference(got[key], want[key]) for key in want]
        return max(r[0] for r in results), all(r[1] for r in results)
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    diff = (got - want).abs()
    return float(diff.max()), bool(torch.all(diff <= ATOL + RTOL * want.abs()))


def judge(ds, pt, say=print):
    """The first (step, quantity) outside the tolerance, or None: each step's lr, losses, gradient norm (where
    DeepSpeed reports one) and parameters; zero_to_fp32's weights against the fp32 master weights."""
    first = None
    for step in range(STEPS):
        checks = [("lr", ds["lrs"][step], pt["lrs"][step]),
                  ("loss", ds["losses"][step * GAS:(step + 1) * GAS], pt["losses"][step * GAS:(step + 1) * GAS])]
        if ds["grad_norms"][step] is not None:
            checks.append(("grad norm", ds["grad_norms"][step], pt["grad_norms"][step]))
        checks.append(("parameters", ds["params"][step], pt["params"][step]))
        for quantity, got, want in checks:
            largest, close = difference(got, want)
            say(f"step {step} {quantity:<10} max |deepspeed - pytorch| = {largest:.3g}{'' if close else '  <- differs'}")
            if not close and first is None:
                first = (step, quantity)
    if "converted" in ds:
        largest, close = difference(ds["converted"], pt["master"])
        say(f"zero_to_fp32 weights max |deepspeed - pytorch| = {largest:.3g}{'' if close else '  <- differs'}")
        if not close and first is None:
            first = (STEPS - 1, "converted weights")
    return first


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main():
    import deepspeed

    print(f"DeepSpeed {deepspeed.__version__}, torch {torch.__version__}, {WORLD_SIZE} rank(s), "
          f"DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}")
    with tempfile.TemporaryDirectory() as directory:
        context = torch.multiprocessing.start_processes(rank_main, args=(free_port(), directory), nprocs=WORLD_SIZE,
                                                        join=False, start_method="spawn")
        try:
            while not context.join(timeout=300):
                pass
        except Exception as exc:  # a rank that died
            print(f"verdict: crashes: {type(exc).__name__}")
            return 1
        ranks = [torch.load(os.path.join(directory, f"rank{r}.pt"), weights_only=False)
                 if os.path.exists(os.path.join(directory, f"rank{r}.pt")) else {"status": "crashes", "error": "no result"}
                 for r in range(WORLD_SIZE)]
    for status in ("rejected", "crashes"):
        failed = [r for r in ranks if r["status"] == status]
        if failed:
            print(f"DeepSpeed: {failed[0]['error']}")
            print(f"verdict: {status}" + (f": {failed[0]['error'].split(':', 1)[0]}" if status == "crashes" else ""))
            return 1
    first = judge(ranks[0], pytorch_run(ranks[0]["resolved"]))
    if first is not None and GAS > 1:  # dividing by GAS on the loss or on the output's gradient: the same arithmetic
        other = "tensor" if BACKWARD == "engine" else "engine"
        if judge(ranks[0], pytorch_run(ranks[0]["resolved"], other), say=lambda _: None) is None:
            print(f"(agrees with the division by GAS placed as {other} backward places it)")
            first = None
    if first is None:
        print("verdict: agrees")
        return 0
    print(f"DeepSpeed differs from PyTorch first at step {first[0]}, in the {first[1]}")
    print(f"verdict: differs: {first[1]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
''')


def for_group(found: Mapping[str, Any], torch_version: str, python: str) -> tuple[str, str]:
    """(file name, script) of a minimised group of the differential record (``minimised``: its minimal cell, what
    each release measured with it, and ``script.run``: the run's constants)."""
    from ..measured import compress

    by_release: dict[str, str] = found.get("releases", {})
    order = sorted(by_release, key=parse)
    outcomes: dict[str, list[str]] = {}
    for release in order:
        outcomes.setdefault(by_release[release], []).append(release)
    values = ", ".join(f"{k}={v}" for k, v in found.get("set", {}).items()) or "every default"
    name = script_name(found["minimal"])
    measured = "; ".join(f"{outcome} on {compress(releases, order)}"
                         for outcome, releases in sorted(outcomes.items(), key=lambda o: parse(o[1][0])))
    about = textwrap.fill(
        f"Found by the DeepSpeed Fixbook's differential sweep (its page \"Configurations checked\"): the smallest "
        f"configuration it reached that still fails as a larger one did ({values}; everything else DeepSpeed's "
        f"default). Measured on CPU (DeepSpeed's CPU accelerator, gloo) with torch {torch_version}, Python {python}, "
        f"against plain PyTorch: {measured}.", width=116)
    title = f"DeepSpeed against plain PyTorch with {values}."
    return name, script(Settings.from_cell(found["minimal"], found.get("script", {}).get("run")), title, about, name)


def script(settings: Settings, title: str, about: str, name: str = "repro.py") -> str:
    """``settings`` as a standalone script (see the module's docstring). ``title``: its first line; ``about``: the
    paragraph under it (what was found, where)."""
    gaps = reference_gaps(settings)
    if gaps:
        raise ValueError(f"the reference does not model {', '.join(gaps)}: no script")
    tolerance = TOLERANCES[settings.dtype]
    base = [settings.lr] if settings.param_groups == 1 else [settings.lr, settings.lr / 2]
    return TEMPLATE.substitute(
        title=title, about=about, name=name, ranks="rank" if settings.world_size == 1 else f"{settings.world_size} ranks",
        config=_literal(ds_config(settings)), world=settings.world_size, steps=settings.steps,
        gas=settings.gradient_accumulation_steps, micro=settings.micro_batch,
        dtype=str(settings.dtype).removeprefix("torch."), scale=repr(float(settings.loss_scale)),
        optimizer=settings.optimizer, groups=settings.param_groups, lr=repr(settings.lr),
        weight_decay=repr(settings.weight_decay), stage=settings.zero_stage, zero_init=settings.zero_init,
        checkpoint=settings.checkpoint, backward=settings.backward, clip=repr(float(settings.gradient_clipping)),
        accum=settings.grad_accum_dtype, lrs=_literal(scheduled_lrs(settings, base)),
        each=reduces_every_micro_step(settings), rtol=repr(tolerance.rtol), atol=repr(tolerance.atol),
        in_features=settings.model.in_features, hidden=settings.model.hidden, out_features=settings.model.out_features,
        model_seed=settings.model.seed, data_seed=settings.data_seed, epsilon=repr(CLIP_EPSILON))


def _literal(value: Any, indent: int = 0) -> str:
    """A Python literal of JSON-like ``value``: a dict one key a line (indented), anything else on one line."""
    if isinstance(value, dict) and value:
        inner = " " * (indent + 4)
        items = [f"{inner}{key!r}: {_literal(item, indent + 4)}," for key, item in value.items()]
        return "{\n" + "\n".join(items) + "\n" + " " * indent + "}"
    return repr(json.loads(json.dumps(value)))
