"""How ds-to-universal-zero3-sub-groups is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe.

Also what the notebook and the tests share with it. The job (:func:`sub_group_job`), the conversion run the way
the command line runs it (:func:`convert`), the engine's per-parameter state (:func:`engine_state`) and the resume
through a universal checkpoint (:func:`resume_equivalence`) are :mod:`fixes.harness.universal`'s, re-exported here;
this entry's own: the converted state (:func:`converted_state`, :func:`converted_vs_engine`) and two ranks'
partitions (:func:`rank_trains_and_saves`, :func:`whole_from_partitions`).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any

from ...exceptions import CannotTellError
from ...harness.universal import (SUB_GROUP_SIZE, STATES, convert, engine_state, flat, reference_state,
                                  resume_equivalence, sub_group_job, sub_groups, uninterrupted)

__all__ = ["SUB_GROUP_SIZE", "STATES", "ERROR_TEXT", "convert", "engine_state", "flat", "reference_state",
           "resume_equivalence", "sub_group_job", "sub_groups", "uninterrupted", "converted_state",
           "converted_vs_engine", "is_this_error", "saved_engine", "reproduce", "LOADER_ERROR", "loaded_universal",
           "is_the_loader_error", "rank_trains_and_saves",
           "whole_from_partitions"]

ERROR_TEXT = "exceeds dimension size"
LOADER_ERROR = "loaded state dict contains a parameter group that doesn't match the size of optimizer's group"


def converted_state(output_dir: str) -> dict[str, dict[str, Any]]:
    """{parameter name: {"fp32", "exp_avg", "exp_avg_sq": flat fp32 numpy}} from the universal checkpoint's
    ``zero/<name>/<state>.pt`` files."""
    import torch

    zero = os.path.join(output_dir, "zero")
    state: dict[str, dict[str, Any]] = {}
    for name in sorted(os.listdir(zero)):
        if not os.path.isdir(os.path.join(zero, name)):
            continue
        state[name] = {}
        for key in STATES:
            saved = torch.load(os.path.join(zero, name, f"{key}.pt"), map_location="cpu", weights_only=False)
            tensor = saved["param"] if isinstance(saved, dict) else saved
            state[name][key] = tensor.detach().float().reshape(-1).numpy().copy()
    return state


def converted_vs_engine(converted: dict[str, dict[str, Any]], trained: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """``harness.compare`` of each converted state with the engine's, per state (all parameters
    together, in the engine's order), fp32 tolerance."""
    import numpy as np

    from ...harness import compare

    missing = sorted(set(trained) - set(converted))
    if missing:
        raise AssertionError(f"the universal checkpoint lacks {missing}")
    return {key: compare(np.concatenate([converted[name][key] for name in trained]),
                         np.concatenate([trained[name][key] for name in trained]), "float32", f"{key}: converted vs engine")
            for key in STATES}


def is_this_error(error: BaseException) -> bool:
    """The conversion's failure: ``dump_param_fragment``'s ``narrow`` past the end of a sub-group's tensor."""
    return isinstance(error, RuntimeError) and ERROR_TEXT in str(error) and str(error).startswith("start (")


def saved_engine(directory: str, steps: int = 1) -> dict[str, dict[str, Any]]:
    """``steps`` steps of :func:`sub_group_job` and ``save_checkpoint(directory)``; the engine's per-parameter
    state (:func:`engine_state`)."""
    from ...harness import build_engine, make_batches
    from ...harness.resume import train_steps

    job = sub_group_job(steps=steps)
    engine = build_engine(job)
    if len(engine.optimizer.fp16_groups) < 2:
        raise CannotTellError(f"sub_group_size {SUB_GROUP_SIZE} gave {len(engine.optimizer.fp16_groups)} sub-group(s)")
    train_steps(engine, job, make_batches(job.model, job.steps), range(job.steps))
    engine.save_checkpoint(directory)
    return engine_state(engine)


def loaded_universal(directory: str) -> dict[str, dict[str, Any]]:
    """A fresh :func:`sub_group_job` engine with ``checkpoint.load_universal`` loads the universal checkpoint
    ``convert(directory)`` wrote: its per-parameter state right after loading. Whatever ``load_checkpoint``
    raises propagates."""
    from ...harness import build_engine

    engine = build_engine(sub_group_job(load_universal=True))
    load_path, _ = engine.load_checkpoint(directory)
    if load_path is None:
        raise RuntimeError(f"load_checkpoint found no universal checkpoint in {directory}")
    return engine_state(engine)


def is_the_loader_error(error: BaseException) -> bool:
    """The affected loader's failure: ``torch.optim.Optimizer.load_state_dict`` given every saved sub-group's
    state for an optimizer holding the first sub-group only."""
    return isinstance(error, ValueError) and LOADER_ERROR in str(error)


def reproduce() -> bool:
    """One rank, ZeRO-3 with three optimizer sub-groups, one Adam step, ``save_checkpoint``, then
    ds_to_universal's ``main`` as the command line runs it, then a fresh engine with ``load_universal`` loads
    what it wrote. True if the conversion raises the RuntimeError ``start (...) + length (...) exceeds dimension
    size (...)``, or the fp32 weights or Adam state it wrote differ from the engine's beyond the fp32 tolerance,
    or the load raises ``ValueError: loaded state dict contains a parameter group that doesn't match the size of
    optimizer's group``, or the loaded state differs from the saved engine's."""
    with tempfile.TemporaryDirectory(prefix="fixbook-ds-to-universal-") as directory:
        trained = saved_engine(directory)
        try:
            output = convert(directory)
        except RuntimeError as error:
            if is_this_error(error):
                return True
            raise CannotTellError(f"the conversion failed otherwise: {error}") from error
        except Exception as error:  # noqa: BLE001 - any other failure says nothing about this bug
            raise CannotTellError(f"the conversion failed otherwise: {type(error).__name__}: {error}") from error
        comparisons = converted_vs_engine(converted_state(output), trained)
        if not all(c.close for c in comparisons.values()):
            return True
        try:
            loaded = loaded_universal(directory)
        except ValueError as error:
            if is_the_loader_error(error):
                return True
            raise CannotTellError(f"the load failed otherwise: {error}") from error
        except Exception as error:  # noqa: BLE001 - any other failure says nothing about this bug
            raise CannotTellError(f"the load failed otherwise: {type(error).__name__}: {error}") from error
    return not all(c.close for c in converted_vs_engine(loaded, trained).values())


def rank_trains_and_saves(directory: str, steps: int) -> dict[str, Any]:
    """One rank of a launched job (:func:`fixes.harness.launch`): :func:`sub_group_job` on this rank's own data,
    ``save_checkpoint(directory)`` (every rank writes its optimizer file there); returns this rank's partition of
    each parameter's state (:func:`engine_state`) and its numel."""
    from ...harness import build_engine, make_batches
    from ...harness.resume import train_steps

    job = sub_group_job(steps=steps)
    engine = build_engine(job)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    train_steps(engine, job, make_batches(job.model, job.steps, world_size=world_size), range(steps))
    engine.save_checkpoint(directory)
    numels = {engine.param_names[p]: p.ds_numel for group in engine.optimizer.fp16_groups for p in group}
    return {"state": engine_state(engine), "numel": numels, "sub_groups": sub_groups(engine)}


def whole_from_partitions(ranks: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each parameter's state put together from the ranks' partitions (rank order), its padding cut off."""
    import numpy as np

    first = ranks[0]
    return {name: {key: np.concatenate([rank["state"][name][key] for rank in ranks])[:first["numel"][name]]
                   for key in STATES}
            for name in first["state"]}


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def _optimizer_state(engine: Any) -> dict[str, dict[str, Any]]:
    """{parameter name: {"fp32", "exp_avg", "exp_avg_sq"}} of one rank's engine: ZeRO-3's per sub-group
    (:func:`engine_state`); ZeRO-1/2's cut the same way from each parameter group's flat fp32 partition (with one
    rank the partition is the whole group, its parameters in order)."""
    if engine.zero_optimization_stage() == 3:
        return engine_state(engine)
    optimizer = engine.optimizer
    state: dict[str, dict[str, Any]] = {}
    for group_id, params in enumerate(optimizer.bit16_groups):
        flat_fp32 = optimizer.single_partition_of_fp32_groups[group_id]
        adam = optimizer.optimizer.state[flat_fp32]
        tensors = {"fp32": flat_fp32.detach(), "exp_avg": adam["exp_avg"], "exp_avg_sq": adam["exp_avg_sq"]}
        offset = 0
        for param in params:
            numel = param.numel()
            state[engine.param_names[param]] = {key: tensor.narrow(0, offset, numel).float().cpu().numpy().copy()
                                                for key, tensor in tensors.items()}
            offset += numel
    return state




def _with_load_universal(job: Any) -> Any:
    return job.with_(config={**job.config, "checkpoint": {"load_universal": True}})


def round_trip(job: Any, universal: bool = True) -> bool:
    """:func:`reproduce`'s check for any one-rank Adam ``job``: ``job.steps`` steps, ``save_checkpoint``, then
    (``universal``) ds_to_universal's ``main`` and a fresh engine with ``load_universal`` loads what it wrote, or
    (not ``universal``) a fresh engine loads the checkpoint itself. True if the conversion raises ``start (...) +
    length (...) exceeds dimension size (...)`` or writes states that differ from the engine's, or the load raises
    the loader's ValueError or loads states that differ from the saved engine's."""
    from ...harness import build_engine, make_batches
    from ...harness.resume import train_steps

    with tempfile.TemporaryDirectory(prefix="fixbook-ds-to-universal-grid-") as directory:
        engine = build_engine(job)
        train_steps(engine, job, make_batches(job.model, job.steps), range(job.steps))
        engine.save_checkpoint(directory)
        trained = _optimizer_state(engine)
        del engine
        if universal:
            try:
                output = convert(directory) if job.zero_stage == 3 else convert(directory, inject_missing_state=True)
            except RuntimeError as error:
                if is_this_error(error):
                    return True
                raise CannotTellError(f"the conversion failed otherwise: {error}") from error
            except Exception as error:  # noqa: BLE001 - any other failure says nothing about this bug
                raise CannotTellError(f"the conversion failed otherwise: {type(error).__name__}: {error}") from error
            if not all(c.close for c in converted_vs_engine(converted_state(output), trained).values()):
                return True
        loader = build_engine(_with_load_universal(job) if universal else job)
        try:
            load_path, _ = loader.load_checkpoint(directory)
        except ValueError as error:
            if is_the_loader_error(error):
                return True
            raise CannotTellError(f"the load failed otherwise: {error}") from error
        except Exception as error:  # noqa: BLE001 - any other failure says nothing about this bug
            raise CannotTellError(f"the load failed otherwise: {type(error).__name__}: {error}") from error
        if load_path is None:
            raise CannotTellError(f"load_checkpoint found no checkpoint in {directory}")
        return not all(c.close for c in converted_vs_engine(_optimizer_state(loader), trained).values())


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): one rank, ZeRO-3 with three optimizer sub-groups, one Adam step,
    ``save_checkpoint``, ds_to_universal, a fresh engine with ``load_universal`` (the sweep's check); then each
    condition flipped on its own: ``sub_group_size`` left at its default (one sub-group); the ZeRO-3 checkpoint loaded
    as it is (no ds_to_universal, no ``load_universal``); ZeRO-2 instead, converted with ``--inject_missing_state``
    (how the command line converts a ZeRO-1/2 checkpoint that is not Megatron's) and loaded with ``load_universal``.
    Each cell is :func:`round_trip`: the conversion's error, the loader's error, or states that differ from the saved
    engine's."""
    from ...harness import Cell, trigger_job

    both = ("ds-to-universal", "several-sub-groups")
    base = sub_group_job(steps=1)
    one_group = sub_group_job(steps=1, sub_group_size=int(1e9))
    zero2 = base.with_(zero_stage=2, config={"zero_optimization": {"stage": 2, "sub_group_size": SUB_GROUP_SIZE}})

    def cell(label: str, job: Any, uses: tuple[str, ...], universal: bool, flips: str = "") -> Cell:
        ran = _with_load_universal(job) if universal else job
        return Cell(label, trigger_job(ran, 1, uses=uses), lambda: round_trip(job, universal), flips)

    return [cell("ZeRO-3, three sub-groups, ds_to_universal, load_universal", base, both, True),
            cell("one sub-group (sub_group_size left at 1e9)", one_group, ("ds-to-universal",), True,
                 "uses:several-sub-groups"),
            cell("the ZeRO-3 checkpoint loaded as it is (no ds_to_universal)", base, ("several-sub-groups",), False,
                 "uses:ds-to-universal"),
            cell("ZeRO-2 instead (--inject_missing_state)", zero2, both, True, "zero_stage")]
