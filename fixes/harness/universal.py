"""ZeRO-3 universal checkpoints with several optimizer sub-groups: what the entries on
``deepspeed.checkpoint.ds_to_universal`` and on the ZeRO-3 universal loader share.

* :func:`sub_group_job` — ZeRO-3 + Adam with a small ``sub_group_size``, so that TinyMLP gets the several
  optimizer sub-groups a large model gets with the default ``sub_group_size`` (1e9).
* :func:`sub_groups`, :func:`engine_state`, :func:`adam_steps`, :func:`shared_step` — what a ZeRO-3 engine's
  optimizer holds, sub-group by sub-group.
* :func:`convert` — ``python -m deepspeed.checkpoint.ds_to_universal`` run in this process (so a fix applied
  here takes part); :func:`command_line` — the same command as a shell runs it, in a process of its own forked
  from this one (its exit status, stdout and stderr).
* :func:`resumed`, :func:`uninterrupted`, :func:`reference_state`, :func:`resume_equivalence` — train N steps,
  save, convert, load the universal checkpoint into a fresh engine (``checkpoint.load_universal``), train M
  more; the same N+M steps uninterrupted and in plain PyTorch; compared under ``TOLERANCES``.
  :func:`rank_resumes` — the same resume on each rank of a launched job (:func:`fixes.harness.launch`).

Why not :func:`fixes.harness.resume.resumed` as it is: its optimizer state is read from the inner optimizer's
``param_groups``, which ZeRO-3 keeps empty between steps (``_optimizer_step`` puts one sub-group's flat fp32
tensor there for the length of its step), and it loads with the same job it saved with. Here the state is read
per sub-group from ``fp32_partitioned_groups_flat`` (each sub-group's own Adam ``step`` too), and the engine that
loads is configured with ``load_universal``; the training steps and the plain-PyTorch reference are
:mod:`fixes.harness.resume`'s.

One rank unless a function says otherwise: with one rank a parameter's partition is the whole parameter.
"""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..exceptions import CannotTellError
from .compare import Comparison, compare
from .training import Job

# TinyMLP's parameters hold 128, 16, 64 and 4 values: sub_group_size 50 gives three sub-groups,
# [fc1.weight], [fc1.bias, fc2.weight], [fc2.bias] (DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups
# closes a sub-group once it holds sub_group_size values or more).
SUB_GROUP_SIZE = 50
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # the per-parameter states a universal checkpoint holds


def sub_group_job(steps: int = 2, sub_group_size: int = SUB_GROUP_SIZE, load_universal: bool = False,
                  **changes: Any) -> Job:
    """ZeRO-3, Adam (lr 0.01), ``sub_group_size`` set, ``steps`` optimizer steps; ``load_universal``: the
    ``checkpoint`` section that makes ``load_checkpoint`` read a universal checkpoint (it changes nothing
    else: DeepSpeed reads it only when loading). ``changes``: any other :class:`Job` field (``dtype``...)."""
    config: dict[str, Any] = {"zero_optimization": {"stage": 3, "sub_group_size": sub_group_size}}
    if load_universal:
        config["checkpoint"] = {"load_universal": True}
    return Job(zero_stage=3, optimizer="adam", lr=0.01, steps=steps, config=config).with_(**changes)


def sub_groups(engine: Any) -> list[list[str]]:
    """The ZeRO-3 optimizer's sub-groups, as parameter names, in the optimizer's order."""
    return [[engine.param_names[p] for p in group] for group in engine.optimizer.fp16_groups]


def engine_state(engine: Any) -> dict[str, dict[str, Any]]:
    """{parameter name: {"fp32", "exp_avg", "exp_avg_sq": flat fp32 numpy}} cut from the ZeRO-3 optimizer's
    flat tensors, sub-group by sub-group (this rank's partition: the whole parameter with one rank). The keys
    are in the optimizer's order, which is the model's order for TinyMLP."""
    optimizer = engine.optimizer
    state: dict[str, dict[str, Any]] = {}
    for sub_group_id, params in enumerate(optimizer.fp16_groups):
        flat_fp32 = optimizer.fp32_partitioned_groups_flat[sub_group_id]
        adam = optimizer.optimizer.state[flat_fp32]
        tensors = {"fp32": flat_fp32.detach(), "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
        offset = 0
        for param in params:
            numel = param.partition_numel()
            state[engine.param_names[param]] = {key: tensor.narrow(0, offset, numel).float().cpu().numpy().copy()
                                                for key, tensor in tensors.items()}
            offset += numel
    return state


def adam_steps(engine: Any) -> list[float]:
    """Each sub-group's Adam step count (``state['step']`` of its flat fp32 tensor), in sub-group order."""
    optimizer = engine.optimizer
    return [float(optimizer.optimizer.state[flat_fp32]["step"]) for flat_fp32 in optimizer.fp32_partitioned_groups_flat]


def shared_step(engine: Any) -> bool:
    """Whether two sub-groups' Adam states hold the same ``step`` object."""
    optimizer = engine.optimizer
    steps = [optimizer.optimizer.state[flat_fp32].get("step") for flat_fp32 in optimizer.fp32_partitioned_groups_flat]
    return len({id(s) for s in steps}) < len(steps)


def flat(state: dict[str, dict[str, Any]], key: str, names: list[str]) -> Any:
    """One state of every parameter of ``state`` (as :func:`engine_state` returns it), concatenated in
    ``names``' order."""
    import numpy as np

    return np.concatenate([state[name][key] for name in names])


def convert(checkpoint_dir: str, output_dir: str | None = None, workers: int = 1,
            inject_missing_state: bool = False) -> str:
    """``python -m deepspeed.checkpoint.ds_to_universal --input_folder <checkpoint_dir>/<latest tag>
    --output_folder <output_dir>`` in this process: the module's own ``parse_arguments()`` and ``main()``,
    as its ``__main__`` block runs them (so a fix applied here takes part). ``workers``: the
    ``--num_extract_workers`` and ``--num_merge_workers`` (1: no worker processes). The default output folder
    is ``<tag>_universal`` beside the tag; ``main`` writes ``latest_universal`` next to it. Returns it.
    ``inject_missing_state``: the flag a ZeRO-1/2 checkpoint that is not Megatron's needs (it carries no
    ``universal_checkpoint_info``). Whatever ``main`` raises propagates; its own printing is swallowed."""
    from deepspeed.checkpoint import ds_to_universal

    with open(os.path.join(checkpoint_dir, "latest")) as handle:
        tag = handle.read().strip()
    input_folder = os.path.join(checkpoint_dir, tag)
    output_dir = output_dir or os.path.join(checkpoint_dir, f"{tag}_universal")
    argv = ["ds_to_universal.py", "--input_folder", input_folder, "--output_folder", output_dir,
            "--num_extract_workers", str(workers), "--num_merge_workers", str(workers)]
    argv += ["--inject_missing_state"] if inject_missing_state else []
    saved_argv, sys.argv = sys.argv, argv
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its own chatter (the args, the steps)
            ds_to_universal.main(ds_to_universal.parse_arguments())
    finally:
        sys.argv = saved_argv
    return output_dir


def _command_line_child(argv: list[str], stdout_path: str, stderr_path: str) -> None:
    """:func:`command_line`'s child: the module as ``__main__`` with ``argv``, its output into the two files."""
    import runpy

    for fd, path in ((1, stdout_path), (2, stderr_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = argv
    runpy.run_module("deepspeed.checkpoint.ds_to_universal", run_name="__main__", alter_sys=True)


def command_line(*arguments: str) -> subprocess.CompletedProcess:
    """``python -m deepspeed.checkpoint.ds_to_universal ARGUMENTS`` as a shell runs it: its exit status, stdout and
    stderr. It runs in a process forked from this one (the installed DeepSpeed, without importing torch and DeepSpeed
    again), as ``__main__`` with those arguments; an uncaught exception's traceback goes to stderr and the status is
    1, as the interpreter's. Called before a fix is applied, it runs DeepSpeed's own code, as the user's shell does."""
    import multiprocessing

    argv = ["ds_to_universal.py", *arguments]
    with tempfile.TemporaryDirectory(prefix="fixbook-ds-to-universal-") as scratch:
        paths = [os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")]
        child = multiprocessing.get_context("fork").Process(target=_command_line_child, args=(argv, *paths))
        child.start()
        child.join()
        stdout, stderr = (Path(path).read_text(encoding="utf-8", errors="replace") for path in paths)
    return subprocess.CompletedProcess(argv, child.exitcode, stdout, stderr)


def uninterrupted(steps: int, dtype: str = "float32", sub_group_size: int = SUB_GROUP_SIZE) -> dict[str, Any]:
    """All ``steps`` of :func:`sub_group_job` in one engine: each sub-group's Adam step count (``steps``),
    the per-parameter state (``end``) and the gathered weights (``weights``)."""
    from .env import device  # noqa: F401 - set-up is the caller's (harness.setup())
    from .models import make_batches
    from .resume import train_steps
    from .training import build_engine, gathered_params

    job = sub_group_job(steps=steps, sub_group_size=sub_group_size, dtype=dtype)
    engine = build_engine(job)
    train_steps(engine, job, make_batches(job.model, job.steps), range(steps))
    return {"steps": adam_steps(engine), "end": engine_state(engine), "weights": gathered_params(engine.module)}


def resumed(directory: str, steps: int, saved_after: int, dtype: str = "float32",
            sub_group_size: int = SUB_GROUP_SIZE) -> dict[str, Any]:
    """``saved_after`` steps of :func:`sub_group_job`, ``save_checkpoint(directory)``, :func:`convert`, a fresh
    engine with ``checkpoint.load_universal``, ``load_checkpoint(directory)``, the remaining steps.

    Returns the saving engine's per-parameter state (``saved``) and Adam step counts (``saved_steps``); the
    fresh engine's right after loading (``loaded``, ``loaded_steps``) and whether its sub-groups then share one
    ``step`` object (``shared``); its state, step counts and gathered weights at the end (``end``, ``steps``,
    ``weights``). CannotTellError if the job has fewer than two sub-groups; whatever the conversion or
    ``load_checkpoint`` raises propagates."""
    from .models import make_batches
    from .resume import train_steps
    from .training import build_engine, gathered_params

    if not 0 < saved_after < steps:
        raise ValueError(f"saved_after={saved_after} must lie between 0 and steps={steps}")
    job = sub_group_job(steps=steps, sub_group_size=sub_group_size, dtype=dtype)
    batches = make_batches(job.model, job.steps)
    first = build_engine(job)
    if len(first.optimizer.fp16_groups) < 2:
        raise CannotTellError(f"sub_group_size {sub_group_size} gave {len(first.optimizer.fp16_groups)} sub-group(s)")
    train_steps(first, job, batches, range(saved_after))
    first.save_checkpoint(directory)
    saved, saved_steps = engine_state(first), adam_steps(first)
    del first
    convert(directory)
    second = build_engine(sub_group_job(steps=steps, sub_group_size=sub_group_size, dtype=dtype, load_universal=True))
    load_path, _ = second.load_checkpoint(directory)
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found no universal checkpoint in {directory}")
    loaded, loaded_steps, shared = engine_state(second), adam_steps(second), shared_step(second)
    train_steps(second, job, batches, range(saved_after, steps))
    return {"saved": saved, "saved_steps": saved_steps, "loaded": loaded, "loaded_steps": loaded_steps,
            "shared": shared, "steps": adam_steps(second), "end": engine_state(second),
            "weights": gathered_params(second.module)}


def reference_state(steps: int, dtype: str = "float32", world_size: int = 1,
                    sub_group_size: int = SUB_GROUP_SIZE) -> dict[str, Any]:
    """Plain PyTorch Adam on :func:`sub_group_job` (data parallel over ``world_size`` ranks, each its own data):
    {"weights": {name: array}} and, with one rank, "exp_avg"/"exp_avg_sq" flat over the parameters in the
    model's order and "step" (:func:`fixes.harness.resume.reference`)."""
    from .resume import reference
    from .training import train_reference

    job = sub_group_job(steps=steps, sub_group_size=sub_group_size, dtype=dtype)
    if world_size > 1:
        return {"weights": train_reference(job, world_size=world_size).params}
    ref = reference(job)
    return {"weights": ref.params, "exp_avg": ref.state["exp_avg"], "exp_avg_sq": ref.state["exp_avg_sq"],
            "step": float(ref.state["step"][0])}


def resume_equivalence(steps: int = 4, saved_after: int = 2, dtype: str = "float32",
                       sub_group_size: int = SUB_GROUP_SIZE) -> dict[str, Comparison]:
    """Resume equivalence through a universal checkpoint: :func:`resumed` (N = ``saved_after`` steps, save,
    convert, load into a fresh engine, M = ``steps - saved_after`` more) against :func:`uninterrupted` and
    against plain PyTorch (:func:`reference_state`), under the ``dtype``'s tolerance (the DeepSpeed runs
    against each other: their fp32 master state, fp32 tolerance).

    Returns {"<against>: <quantity>": Comparison}, ``against`` "resumed vs uninterrupted" or "resumed vs
    PyTorch", ``quantity`` "weights" (the gathered model weights), "exp_avg", "exp_avg_sq", "step" (every
    sub-group's own Adam step count: one value per sub-group) and, against the uninterrupted run, "fp32" (the
    master weights) and "loaded vs saved: <state>" (the fresh engine right after loading against the saving
    one). A universal checkpoint that cannot be made or loaded raises what DeepSpeed raised."""
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="fixbook-universal-resume-") as directory:
        run = resumed(directory, steps, saved_after, dtype, sub_group_size)
    whole = uninterrupted(steps, dtype, sub_group_size)
    ref = reference_state(steps, dtype, sub_group_size=sub_group_size)
    names = list(whole["end"])
    out: dict[str, Comparison] = {}
    for key in STATES:
        label = f"loaded vs saved: {key}"
        out[label] = compare(flat(run["loaded"], key, names), flat(run["saved"], key, names), "float32", label)
    out["loaded vs saved: step"] = compare(np.array(run["loaded_steps"]), np.array(run["saved_steps"]), "float32",
                                           "loaded vs saved: step")
    against = "resumed vs uninterrupted"
    out[f"{against}: weights"] = compare(run["weights"], whole["weights"], dtype, f"{against}: weights")
    for key in STATES:
        out[f"{against}: {key}"] = compare(flat(run["end"], key, names), flat(whole["end"], key, names), "float32",
                                           f"{against}: {key}")
    out[f"{against}: step"] = compare(np.array(run["steps"]), np.array(whole["steps"]), "float32", f"{against}: step")
    against = "resumed vs PyTorch"
    out[f"{against}: weights"] = compare(run["weights"], ref["weights"], dtype, f"{against}: weights")
    for key in ("exp_avg", "exp_avg_sq"):
        out[f"{against}: {key}"] = compare(flat(run["end"], key, names), ref[key], dtype, f"{against}: {key}")
    out[f"{against}: step"] = compare(np.array(run["steps"]), np.full(len(run["steps"]), ref["step"]), "float32",
                                      f"{against}: step")
    return out


def rank_resumes(directory: str, steps: int, saved_after: int) -> dict[str, Any]:
    """One rank of a launched job (:func:`fixes.harness.launch`), on this rank's own data: ``saved_after`` steps of
    :func:`sub_group_job`, ``save_checkpoint(directory)`` (every rank writes its files), rank 0 converts it, a
    fresh engine with ``load_universal`` loads it and takes the remaining steps. Returns each sub-group's Adam step
    count at the end (``steps``) and the gathered weights (``weights``), to compare with plain PyTorch data
    parallel (:func:`reference_state` with ``world_size``)."""
    import torch.distributed as dist

    from .models import make_batches
    from .resume import train_steps
    from .training import build_engine, gathered_params

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    job = sub_group_job(steps=steps)
    batches = make_batches(job.model, job.steps, world_size=world_size)
    first = build_engine(job)
    train_steps(first, job, batches, range(saved_after))
    first.save_checkpoint(directory)
    del first
    dist.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        convert(directory)
    dist.barrier()
    second = build_engine(sub_group_job(steps=steps, load_universal=True))
    load_path, _ = second.load_checkpoint(directory)
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found no universal checkpoint in {directory}")
    train_steps(second, job, batches, range(saved_after, steps))
    return {"steps": adam_steps(second), "weights": gathered_params(second.module)}
