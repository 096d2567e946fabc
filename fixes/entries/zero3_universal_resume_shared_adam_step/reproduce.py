"""How zero3-universal-resume-shared-adam-step is reproduced: the fast check the release sweep runs
(``reproduce()``: True where the bug shows), with no fix applied. Imported by the sweep, the tests and the
notebook, never by the fix or its probe.

The job, the per-sub-group state, the conversion and the resume are :mod:`fixes.harness.universal`'s, shared with the
entry ds-to-universal-zero3-sub-groups: ZeRO-3, Adam, TinyMLP split into three optimizer sub-groups by
``sub_group_size``, and ``deepspeed.checkpoint.ds_to_universal``'s ``main`` run in this process.

On the releases before 0.18.0 DeepSpeed alone cannot make or load a universal checkpoint with several sub-groups:
the conversion fails (``RuntimeError: start (...) + length (...) exceeds dimension size (...)``), and so does the
loader (``ValueError: loaded state dict contains a parameter group that doesn't match the size of optimizer's
group``), the entry ds-to-universal-zero3-sub-groups. The sweep measures this entry there with that entry's fix
applied (:func:`measurement_context`, ``FixInfo.measured_under``): the conversion and a loader that fills every
sub-group, each with its own Adam step, so the resume runs and shows whether the step count goes wrong. Without it
:func:`reproduce` raises :class:`CannotTellError` there.
"""
from __future__ import annotations

import contextlib
import tempfile
from typing import Any, Iterator

from ...exceptions import CannotTellError
from ...harness import universal
from ...harness.universal import (SUB_GROUP_SIZE, STATES, adam_steps, convert, engine_state, flat, reference_state,
                                  shared_step, sub_groups, uninterrupted)

__all__ = ["SUB_GROUP_SIZE", "STATES", "STEPS", "SAVED_AFTER", "adam_steps", "convert", "engine_state", "flat",
           "reference_state", "shared_step", "sub_groups", "uninterrupted", "sub_group_job", "resumed",
           "resume_vs_uninterrupted", "reproduce", "rank_resumes", "measurement_context", "PREREQUISITE"]

PREREQUISITE = "ds-to-universal-zero3-sub-groups"  # its bug hides this one before 0.18.0
STEPS = 3  # optimizer steps in all
SAVED_AFTER = 2  # the checkpoint is saved after this many; the resumed engine runs the rest


def sub_group_job(steps: int = STEPS, sub_group_size: int = SUB_GROUP_SIZE, load_universal: bool = False,
                  **changes: Any) -> Any:
    """:func:`fixes.harness.universal.sub_group_job`, :data:`STEPS` steps unless told."""
    return universal.sub_group_job(steps, sub_group_size, load_universal, **changes)


def resumed(directory: str, steps: int = STEPS, saved_after: int = SAVED_AFTER,
            dtype: str = "float32") -> dict[str, Any]:
    """:func:`fixes.harness.universal.resumed` (save after ``saved_after`` steps, convert, load into a fresh engine
    with ``load_universal``, train to ``steps``): each sub-group's Adam step counts when saved, after loading and at
    the end, whether the loaded sub-groups share one ``step`` object, the per-parameter states and the weights."""
    return universal.resumed(directory, steps, saved_after, dtype)


@contextlib.contextmanager
def measurement_context() -> Iterator[None]:
    """The sweep's conditions: where DeepSpeed has :data:`PREREQUISITE`'s bug (its probe, 0.16.0 - 0.17.6), that
    entry's fix applied (the conversion and the ZeRO-3 universal loader), so that a universal checkpoint with
    several sub-groups can be made and loaded at all; elsewhere the installed code as it is. Reverted on exit."""
    import fixes

    prerequisite = fixes.get(PREREQUISITE)
    if not prerequisite.is_affected() or prerequisite.applied:
        yield
        return
    fixes.apply(PREREQUISITE)
    try:
        yield
    finally:
        fixes.revert(PREREQUISITE)


def resume_vs_uninterrupted(dtype: str = "float32") -> dict[str, Any]:
    """:func:`resumed` and :func:`uninterrupted`; CannotTellError where no universal checkpoint with several
    sub-groups can be made or loaded (the conversion or the loader fails)."""
    with tempfile.TemporaryDirectory(prefix="fixbook-zero3-universal-resume-") as directory:
        try:
            resume = resumed(directory, dtype=dtype)
        except CannotTellError:
            raise
        except Exception as error:  # noqa: BLE001 - a failure to convert or load says nothing about the step count
            raise CannotTellError(f"no universal checkpoint with several sub-groups could be made and loaded: "
                                  f"{type(error).__name__}: {error}".splitlines()[0][:300]) from error
    return {"resumed": resume, "uninterrupted": uninterrupted(STEPS, dtype)}


def reproduce() -> bool:
    """One rank, ZeRO-3 with three optimizer sub-groups, two Adam steps, ``save_checkpoint``, ds_to_universal's
    ``main``, a fresh engine with ``load_universal`` loads it and takes the third step. True if any sub-group's
    Adam step count then differs from the uninterrupted run's (3), or the fp32 weights differ from it beyond the
    fp32 tolerance. CannotTellError where the conversion or the loading fails (the releases before 0.18.0 without
    :func:`measurement_context`)."""
    from ...harness import compare

    runs = resume_vs_uninterrupted()
    resume, straight = runs["resumed"], runs["uninterrupted"]
    names = list(straight["end"])
    weights = compare(flat(resume["end"], "fp32", names), flat(straight["end"], "fp32", names), "float32",
                      "fp32 weights: resumed vs uninterrupted")
    return resume["steps"] != straight["steps"] or not weights.close


def rank_resumes(directory: str, steps: int = STEPS, saved_after: int = SAVED_AFTER) -> dict[str, Any]:
    """:func:`fixes.harness.universal.rank_resumes` (one rank of a launched job: save, rank 0 converts, resume),
    :data:`STEPS` and :data:`SAVED_AFTER` unless told."""
    return universal.rank_resumes(directory, steps, saved_after)


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def _steps_and_master(engine: Any) -> tuple[list[float], Any]:
    """Each optimizer sub-group's (ZeRO-3) or parameter group's (ZeRO-1/2) Adam step count, and the fp32 master
    weights flat (one rank: the whole of each flat partition)."""
    import numpy as np

    if engine.zero_optimization_stage() == 3:
        state = engine_state(engine)
        return adam_steps(engine), flat(state, "fp32", list(state))
    optimizer = engine.optimizer
    flats = optimizer.single_partition_of_fp32_groups
    return ([float(optimizer.optimizer.state[flat_fp32]["step"]) for flat_fp32 in flats],
            np.concatenate([flat_fp32.detach().float().cpu().numpy() for flat_fp32 in flats]))




def resume_differs(job: Any, universal: bool = True, saved_after: int = SAVED_AFTER) -> bool:
    """:func:`reproduce`'s check for any one-rank Adam ``job``: ``saved_after`` steps, ``save_checkpoint``, then
    (``universal``) ds_to_universal and a fresh engine with ``load_universal`` loads what it wrote, or (not
    ``universal``) a fresh engine loads the checkpoint itself; it takes the remaining steps. True if any sub-group's
    (parameter group's) Adam step count then differs from the uninterrupted run's, or the fp32 master weights differ
    from it beyond the fp32 tolerance. CannotTellError where the conversion or the load fails."""
    from ...harness import build_engine, compare, make_batches
    from ...harness.resume import train_steps

    batches = make_batches(job.model, job.steps)
    with tempfile.TemporaryDirectory(prefix="fixbook-zero3-universal-resume-grid-") as directory:
        first = build_engine(job)
        train_steps(first, job, batches, range(saved_after))
        first.save_checkpoint(directory)
        del first
        loading = job
        try:
            if universal:
                if job.zero_stage == 3:
                    convert(directory)
                else:
                    convert(directory, inject_missing_state=True)
                loading = job.with_(config={**job.config, "checkpoint": {"load_universal": True}})
            second = build_engine(loading)
            load_path, _ = second.load_checkpoint(directory)
        except Exception as error:  # noqa: BLE001 - a failure to convert or load says nothing about the step count
            raise CannotTellError(f"the checkpoint could not be made or loaded: {type(error).__name__}: "
                                  f"{error}".splitlines()[0][:300]) from error
        if load_path is None:
            raise CannotTellError(f"load_checkpoint found no checkpoint in {directory}")
        train_steps(second, job, batches, range(saved_after, job.steps))
    straight = build_engine(job)
    train_steps(straight, job, batches, range(job.steps))
    (resumed_steps, resumed_master), (steps, master) = _steps_and_master(second), _steps_and_master(straight)
    return resumed_steps != steps or not compare(resumed_master, master, "float32", "fp32 master weights").close


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the sweep's check (one rank, ZeRO-3 with three optimizer
    sub-groups, two Adam steps, ``save_checkpoint``, ds_to_universal, a fresh engine with ``load_universal`` takes the
    third), then each condition flipped on its own, each cell :func:`resume_differs`: ``sub_group_size`` left at its
    default (one sub-group); the ZeRO-3 checkpoint loaded as it is (no ``load_universal``, no conversion); ZeRO-2
    instead, converted with ``--inject_missing_state`` (how the command line converts a ZeRO-1/2 checkpoint that is
    not Megatron's) and loaded with ``load_universal``."""
    from ...harness import Cell, trigger_job

    base = sub_group_job()
    one_group = sub_group_job(sub_group_size=int(1e9))
    zero2 = base.with_(zero_stage=2, config={"zero_optimization": {"stage": 2, "sub_group_size": SUB_GROUP_SIZE}})

    def cell(label: str, job: Any, uses: tuple[str, ...], universal: bool, flips: str = "") -> Cell:
        ran = job.with_(config={**job.config, "checkpoint": {"load_universal": True}}) if universal else job
        return Cell(label, trigger_job(ran, 1, uses=uses + (("ds-to-universal",) if universal else ())),
                    lambda: resume_differs(job, universal), flips)

    return [Cell("ZeRO-3, three sub-groups, resumed with load_universal",
                 trigger_job(sub_group_job(load_universal=True), 1, uses=("several-sub-groups", "ds-to-universal")),
                 reproduce),
            cell("one sub-group (sub_group_size left at 1e9)", one_group, (), True, "uses:several-sub-groups"),
            cell("the ZeRO-3 checkpoint loaded as it is (no load_universal)", base, ("several-sub-groups",), False,
                 "load_universal"),
            cell("ZeRO-2 instead (--inject_missing_state)", zero2, ("several-sub-groups",), True, "zero_stage")]
