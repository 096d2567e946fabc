"""Shared notebook harness: what every entry's notebook needs, so its cells read like the user's
own training script.

* ``setup()`` — single-process DeepSpeed on CPU (gloo) or CUDA; ``launch()`` — N ranks, hang-safe.
* ``TinyMLP``/``make_batches`` — tiny deterministic models and data.
* ``Job``, ``train_deepspeed()``, ``train_reference()`` — one job, through DeepSpeed and in plain PyTorch.
* ``assert_close()``/``assert_differs()`` with ``TOLERANCES`` — the one per-dtype tolerance table.
* ``begin()`` — a notebook's opening: set-up, probe, matrix check, record.
* ``versus_reference()`` — one job through DeepSpeed and plain PyTorch, compared (params, grad norms).
* ``Report`` — the record the runner reads.
* ``attempt()``/``attempt_all()`` — train a job that may crash: its result, or the error and where it was raised.
* ``backward_modes()`` — one job through ``engine.backward`` and through direct ``tensor.backward()`` calls, compared.
* ``allow_fp16_on_cpu()``/``fp16_on_cpu()`` — let DeepSpeed's CPU accelerator run fp16 (CPU reproduction only).
* ``PipeJob``, ``run_pipelines()``, ``versus_sequential()`` — a tiny 2-stage ``PipelineModule`` job vs plain PyTorch.
* ``observe_ranks()`` — what each rank did (finished, raised, or stuck and where), bounded by a timeout.
* ``autograd_audit`` — every ``autograd.Function`` in the installed DeepSpeed, legacy or not, and which ones run.
* ``FuncCase``/``run_case_in_child()`` — ``torch.func`` over a whole ZeRO-3 model in child ranks (crash-safe) vs plain PyTorch.
* ``gathering`` — ``GatheredParameters`` over a whole ZeRO-3 model after every step: all at once vs one at a time.
"""
from . import autograd_audit, gathering
from .attempts import Attempt, attempt, attempt_all
from .backward_modes import BackwardModes, backward_modes, backward_modes_all
from .compare import TOLERANCES, Comparison, Tolerance, assert_close, assert_differs, compare, dtype_of
from .entry import Entry, begin
from .func_transforms import CaseOutcome, FuncCase, reference_transforms, run_case_in_child, zero3_func_job
from .env import Environment, describe, device, free_port, setup
from .launch import launch, to_numpy
from .models import Batches, ModelSpec, TinyMLP, make_batches, mse
from .observe import RankOutcome, observe_ranks
from .precision import allow_fp16_on_cpu, fp16_allowed_on_cpu, fp16_on_cpu, restore_fp16_support
from .pipeline import PipeJob, PipeResult, PipeVersus, run_pipelines, train_pipeline, train_sequential, versus_sequential
from .report import Report, print_table
from .training import (Job, TrainResult, build_engine, ds_config, gathered_params, original_functional_linear, run_job,
                       train_deepspeed, train_reference)
from .versus import Versus, versus_reference

__all__ = [
    "Attempt", "attempt", "attempt_all", "BackwardModes", "backward_modes", "backward_modes_all",
    "autograd_audit", "gathering", "CaseOutcome", "FuncCase", "reference_transforms", "run_case_in_child", "zero3_func_job",
    "allow_fp16_on_cpu", "fp16_allowed_on_cpu", "fp16_on_cpu", "restore_fp16_support",
    "PipeJob", "PipeResult", "PipeVersus", "RankOutcome", "observe_ranks", "run_pipelines", "train_pipeline",
    "train_sequential", "versus_sequential",
    "TOLERANCES", "Batches", "Comparison", "Entry", "Environment", "Versus", "begin", "versus_reference", "Job", "ModelSpec", "Report", "TinyMLP", "Tolerance",
    "TrainResult", "assert_close", "build_engine", "assert_differs", "compare", "describe", "device", "ds_config", "dtype_of",
    "free_port", "gathered_params", "launch", "make_batches", "mse", "original_functional_linear", "print_table", "run_job",
    "setup", "to_numpy", "train_deepspeed", "train_reference"
]
