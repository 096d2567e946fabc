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
import os
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
