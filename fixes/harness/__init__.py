"""The shared reproduction harness: what two or more entries' notebooks, checks and tests use (an entry's
own reproduction code lives with the entry, in ``fixes/entries/<id>/``). Never imported by a fix or a probe.

* ``setup()`` — single-process DeepSpeed on CPU (gloo) or CUDA; ``launch()`` — N ranks, hang-safe.
* ``TinyMLP``/``make_batches`` — tiny deterministic models and data.
* ``Job``, ``train_deepspeed()``, ``train_reference()`` — one job, through DeepSpeed and in plain PyTorch.
* ``assert_close()``/``assert_differs()`` with ``TOLERANCES`` — the one per-dtype tolerance table.
* ``begin()`` — a notebook's opening: set-up, probe, matrix check, record.
* ``versus_reference()`` — one job through DeepSpeed and plain PyTorch, compared (params, grad norms).
* ``ScriptOutcome``/``launch_script()`` — a user's own script in a launched rank next to its reference.
* ``Report`` — the record the runner reads.
* ``data_parallel_script()`` — one rank of a user's training script, for notebooks to show and launch.
* ``allow_fp16_on_cpu()``/``fp16_on_cpu()`` — let DeepSpeed's CPU accelerator run fp16 (CPU reproduction only).
"""
from .compare import TOLERANCES, Comparison, Tolerance, assert_close, assert_differs, compare, dtype_of
from .entry import Entry, begin, probe_in_ranks
from .env import Environment, describe, device, fold_repeated_warnings, free_port, setup
from .launch import launch, to_numpy
from .models import Batches, ModelSpec, TinyMLP, make_batches, mse
from .precision import allow_fp16_on_cpu, fp16_allowed_on_cpu, fp16_on_cpu, restore_fp16_support
from .report import Report, print_table, show_code
from .scripts import data_parallel_script
from .triggers import Cell, trigger_job
from .training import (Job, TrainResult, bench_job, build_engine, ds_config, gathered_params, original_functional_linear, run_job,
                       train_deepspeed, train_reference)
from .versus import ScriptOutcome, Versus, launch_script, versus_reference

__all__ = [
    "allow_fp16_on_cpu", "fp16_allowed_on_cpu", "fp16_on_cpu", "restore_fp16_support",
    "TOLERANCES", "Batches", "Comparison", "Entry", "Environment", "ScriptOutcome", "Versus", "launch_script", "begin", "probe_in_ranks", "Cell", "trigger_job", "versus_reference", "Job", "ModelSpec", "Report", "TinyMLP", "Tolerance",
    "TrainResult", "assert_close", "bench_job", "data_parallel_script", "build_engine", "assert_differs", "compare", "describe", "device", "ds_config", "dtype_of",
    "fold_repeated_warnings", "free_port", "gathered_params", "launch", "make_batches", "mse", "original_functional_linear", "print_table", "run_job", "show_code",
    "setup", "to_numpy", "train_deepspeed", "train_reference"
]
