"""The covering design: which cells of the space the differential sweep runs.

Not the full product (the space has millions of cells) but a deterministic set in which

* every pair of values of any two dimensions appears in at least one valid cell (a pair no valid cell can hold,
  by the space's constraints, is not required),
* every triple of zero_stage x precision x gradient_accumulation_steps x world_size appears (:data:`TRIPLE`),
* every entry's trigger cell (``fixes/data/triggers.json``) that the space can express is a cell itself.

The generator is greedy (AETG-style, one candidate): the entries' trigger cells first, then every cell the
committed record already holds (``fixes/data/differential.json``, :func:`recorded_cells`); then, while a required
tuple is uncovered, a new cell starts from the first uncovered tuple and fills the other dimensions in the space's
order, each with the value that covers the most uncovered tuples and keeps the cell completable (ties: the earlier
value, so a cell leans to the defaults). No randomness: the same space and record give the same cells. Keeping the
recorded cells makes the design grow, never churn: a new entry's trigger cell adds a cell, and no cell measured
before leaves the design (with its rows, attributions and findings).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import combinations, product
from pathlib import Path
from typing import Any, Iterable, Mapping

from .space import Cell, Space, Value

TRIPLE = ("zero_stage", "precision", "gradient_accumulation_steps", "world_size")

Tuple_ = tuple[tuple[str, Value], ...]  # ((dimension, value), ...) in the space's dimension order


def cell_id(cell: Mapping[str, Value]) -> str:
    """A cell's stable name: 10 hex digits of the digest of its canonical JSON (the same on every machine)."""
    return hashlib.sha256(json.dumps(dict(cell), sort_keys=True).encode()).hexdigest()[:10]


def _key(value: Value) -> tuple[str, Value]:
    return (type(value).__name__, value)  # True and 1 stay apart in sets and dicts


def _tuple_key(t: Tuple_) -> tuple:
    return tuple((name, _key(value)) for name, value in t)


def required_tuples(space: Space) -> list[Tuple_]:
    """The tuples the design must cover, triples first: every completable value triple of :data:`TRIPLE` and
    every completable value pair of two dimensions."""
    order = {name: index for index, name in enumerate(space.names)}
    found: list[Tuple_] = []
    triple = sorted(TRIPLE, key=order.__getitem__)
    for values in product(*(space.dimension(name).values for name in triple)):
        t = tuple(zip(triple, values))
        if space.completable(dict(t)) is not None:
            found.append(t)
    for first, second in combinations(space.dimensions, 2):
        for a, b in product(first.values, second.values):
            t = ((first.name, a), (second.name, b))
            if space.completable(dict(t)) is not None:
                found.append(t)
    return found


def _contains(cell: Mapping[str, Value], t: Tuple_) -> bool:
    return all(name in cell and _key(cell[name]) == _key(value) for name, value in t)


def covering(space: Space, seeds: Iterable[Cell] = ()) -> list[Cell]:
    """``seeds`` (kept, in order) and the greedy cells that cover every required tuple the seeds leave."""
    cells = [dict(seed) for seed in seeds]
    uncovered: dict[tuple, Tuple_] = {_tuple_key(t): t for t in required_tuples(space)}
    by_dimension: dict[str, set[tuple]] = {name: set() for name in space.names}
    for key, t in uncovered.items():
        for name, _ in t:
            by_dimension[name].add(key)

    def cover(cell: Cell) -> None:
        for key in [k for k, t in uncovered.items() if _contains(cell, t)]:
            for name, _ in uncovered.pop(key):
                by_dimension[name].discard(key)

    for cell in cells:
        cover(cell)
    while uncovered:
        cell: Cell = dict(next(iter(uncovered.values())))
        for dimension in space.dimensions:
            if dimension.name in cell:
                continue
            best, best_gain = None, -1
            for value in dimension.values:
                trial = {**cell, dimension.name: value}
                if space.completable(trial) is None:
                    continue
                gain = sum(_contains(trial, uncovered[key]) for key in by_dimension[dimension.name])
                if gain > best_gain:
                    best, best_gain = value, gain
            if best_gain < 0:
                raise RuntimeError(f"no value of {dimension.name} completes {cell}: the space's check let an "
                                   "uncompletable tuple through")
            cell[dimension.name] = best
        space.check_cell(cell)
        cells.append(cell)
        cover(cell)
    return cells


@dataclass(frozen=True)
class Coverage:
    required: int
    covered: int
    missing: tuple[Tuple_, ...]
    pairs_required: int
    triples_required: int
    per_dimension_pair: tuple[tuple[str, str, int, int], ...]  # (dim a, dim b, value pairs covered, required)

    @property
    def complete(self) -> bool:
        return not self.missing

    def proof(self) -> str:
        """The coverage as lines a reader can check: one line per dimension pair, and the missing tuples."""
        lines = [f"required: {self.pairs_required} value pairs of {len(self.per_dimension_pair)} dimension pairs "
                 f"(those a valid cell can hold) and {self.triples_required} triples of {' x '.join(TRIPLE)}; "
                 f"covered {self.covered} of {self.required}" + (" - complete" if self.complete else " - INCOMPLETE")]
        lines += [f"  {a} x {b}: {got}/{need}" for a, b, got, need in self.per_dimension_pair]
        lines += [f"  missing: {', '.join(f'{n}={v!r}' for n, v in t)}" for t in self.missing]
        return "\n".join(lines)


def coverage(space: Space, cells: Iterable[Mapping[str, Value]]) -> Coverage:
    """Which required tuples ``cells`` hold, counted per dimension pair."""
    cells = list(cells)
    required = required_tuples(space)
    present = {_tuple_key(t) for cell in cells for t in _tuples_of(space, cell)}
    missing = tuple(t for t in required if _tuple_key(t) not in present)
    pairs = [t for t in required if len(t) == 2]
    per: dict[tuple[str, str], list[int]] = {}
    for t in pairs:
        counts = per.setdefault((t[0][0], t[1][0]), [0, 0])
        counts[1] += 1
        counts[0] += _tuple_key(t) in present
    return Coverage(len(required), len(required) - len(missing), missing, len(pairs), len(required) - len(pairs),
                    tuple((a, b, got, need) for (a, b), (got, need) in per.items()))


def _tuples_of(space: Space, cell: Mapping[str, Value]) -> Iterable[Tuple_]:
    names = [n for n in space.names if n in cell]
    for a, b in combinations(names, 2):
        yield ((a, cell[a]), (b, cell[b]))
    triple = [n for n in space.names if n in TRIPLE]
    if all(n in cell for n in triple):
        yield tuple((n, cell[n]) for n in triple)


# ---- the entries' trigger cells ---------------------------------------------------------------------------------

# The trigger's uses the space expresses, as the dimension value they set.
USE_VALUES: dict[str, tuple[str, Value]] = {
    "direct-backward": ("backward", "tensor"),
    "param-groups": ("param_groups", 2),
    "param-group-lrs": ("param_groups", 2),
    "checkpoint-resume": ("checkpoint", "save-load"),
    "zero-to-fp32": ("checkpoint", "zero-to-fp32"),
    "ds-to-universal": ("checkpoint", "universal"),
    "optimizer-without-adam-state": ("optimizer", "torch-sgd"),
    "several-sub-groups": ("sub_group_size", 64),
    "zero-init": ("zero_init", True),
}
# The trigger job's fields the space leaves at DeepSpeed's default: a cell is expressible only with these values.
DEFAULT_FIELDS: dict[str, Any] = {
    "all_reduce_fetch_params": False, "hpz_partition_size": 1, "communication_data_type": "unset",
    "autotp_size": 1, "elasticity": False, "autotuning": False, "warmup_max_lr": "unset",
}


def project_trigger_job(space: Space, job: Mapping[str, Any]) -> tuple[Cell | None, str]:
    """An entry's recorded trigger job (``fixes/data/triggers.json``) as a cell of the space (dimensions it does not
    set take their defaults), or (None, why it cannot be expressed). Accumulation of more than one micro-batch
    becomes 3 (the space's accumulating value)."""
    cell = space.defaults()
    why: list[str] = []
    for name, default in DEFAULT_FIELDS.items():
        value = job.get(name, default)
        if value not in (default, None, [], ()) and not (name == "hpz_partition_size" and value == 1):
            why.append(f"{name} {value!r}")
    if job.get("load_universal"):
        cell["checkpoint"] = "universal"
    gas = job.get("gradient_accumulation_steps")
    if gas is None:
        why.append("gradient_accumulation_steps unresolved")
    else:
        cell["gradient_accumulation_steps"] = 1 if gas == 1 else 3
    precision = job.get("precision")
    cell["precision"] = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16-static"}.get(precision, precision)
    clipping = job.get("gradient_clipping")
    if clipping in (0, 0.0):
        cell["gradient_clipping"] = 0.0
    elif isinstance(clipping, (int, float)) and not isinstance(clipping, bool):
        cell["gradient_clipping"] = 0.5
    else:
        why.append(f"gradient_clipping {clipping!r} (the space pins it; its default moved in 0.19.3)")
    scheduler = job.get("scheduler", "unset")
    cell["scheduler"] = "none" if scheduler == "unset" else scheduler
    for name, field in (("zero_stage", "zero_stage"), ("world_size", "world_size"),
                        ("grad_accum_dtype", "grad_accum_dtype")):
        if job.get(field) is None:
            why.append(f"{field} unresolved")
        else:
            cell[name] = job[field]
    cell["offload_optimizer"] = "cpu" if job.get("offload_optimizer") else "none"
    cell["contiguous_gradients"] = bool(job.get("contiguous_gradients", True))
    for use in job.get("uses") or ():
        if use in USE_VALUES:
            name, value = USE_VALUES[use]
            cell[name] = value
        else:
            why.append(f"use {use}")
    for name, value in cell.items():
        if not any(type(value) is type(v) and value == v for v in space.dimension(name).values):
            why.append(f"{name} {value!r} is not a value of the space")
    if why:
        return None, "; ".join(why)
    broken = space.broken(cell)
    if broken:
        return None, "breaks: " + "; ".join(c.why for c in broken)
    return cell, ""


@dataclass(frozen=True)
class TriggerCell:
    entry: str
    label: str
    cell: Cell | None
    why_not: str = ""


def trigger_cells(space: Space, path: Path | None = None) -> list[TriggerCell]:
    """Every recorded trigger cell of every entry, projected onto the space (:func:`project_trigger_job`)."""
    from fixes.trigger import GRIDS

    data = json.loads(Path(path or GRIDS).read_text()).get("entries", {})
    found = []
    for entry in sorted(data):
        for recorded in data[entry]["cells"]:
            cell, why = project_trigger_job(space, recorded["job"])
            found.append(TriggerCell(entry, recorded["label"], cell, why))
    return found


@dataclass(frozen=True)
class Design:
    cells: tuple[Cell, ...]
    origins: tuple[tuple[str, ...], ...]  # per cell: "covering" and/or "trigger ENTRY" for each trigger cell it is
    triggers: tuple[TriggerCell, ...]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(cell_id(cell) for cell in self.cells)


def recorded_cells(space: Space, path: Path | None = None) -> dict[str, tuple[Cell, list[str]]]:
    """{cell id: (cell, its origins)} of the record's cells that are cells of ``space`` (every dimension, each value
    one of the dimension's, the constraints hold), in id order."""
    from . import record as record_module

    data = record_module.read(path) if path is not None else record_module.read()
    kept = {}
    for key in sorted(data.cells):
        cell, origins = data.cells[key]["cell"], list(data.cells[key].get("origins", ["covering"]))
        if set(cell) != set(space.names) or not space.allows(cell):
            continue
        if all(any(type(cell[name]) is type(v) and cell[name] == v for v in space.dimension(name).values)
               for name in space.names):
            kept[key] = (dict(cell), origins)
    return kept


def build(space: Space, triggers_path: Path | None = None, record_path: Path | None = None) -> Design:
    """The design: the expressible trigger cells (each once, in entry order), the recorded cells
    (:func:`recorded_cells`), then the greedy covering cells."""
    triggers = trigger_cells(space, triggers_path)
    seeds: dict[str, Cell] = {}
    origins: dict[str, list[str]] = {}
    for t in triggers:
        if t.cell is not None:
            key = cell_id(t.cell)
            seeds.setdefault(key, t.cell)
            tag = f"trigger {t.entry}"
            if tag not in origins.setdefault(key, []):
                origins[key].append(tag)
    for key, (cell, recorded) in recorded_cells(space, record_path).items():
        if key not in seeds:  # measured before: stays, as the covering (or trigger) cell it was
            seeds[key] = cell
            origins[key] = [o for o in recorded if not o.startswith("trigger ")] or ["covering"]
    cells = covering(space, seeds.values())
    ids = [cell_id(cell) for cell in cells]
    if len(set(ids)) != len(ids):
        cells = list({cell_id(cell): cell for cell in cells}.values())
    return Design(tuple(cells), tuple(tuple(origins.get(cell_id(cell), ["covering"])) for cell in cells),
                  tuple(triggers))
