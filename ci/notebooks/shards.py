"""Shards: one deterministic part of a run's work, so that N machines side by side do it all once.

    python -m ci.notebooks.runner --shard 2/3  # the second of three parts of the notebook matrix
    python -m ci.sweep --shard 2/3             # the second of three parts of the release sweep

Every machine computes the same partition from the same checkout: the units (the runner's runs, the sweep's
releases) are balanced by their recorded seconds, longest first, each to the part with the least work so far
(ties: fewer units, then the lower part number). Where any unit's seconds are unknown (a new entry, a new
release), the split is by count instead: the units in sorted order, dealt round-robin. Either way a unit is
in exactly one part, and each part keeps the order the units were given in. :func:`digest` names a whole
plan, so a merge can tell that its parts were cut from the same one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence, TypeVar

Unit = TypeVar("Unit", bound=Hashable)

BY_SECONDS = "recorded seconds"
BY_COUNT = "count"


class ShardError(ValueError):
    """A shard that cannot be (a bad ``I/N``), or parts that do not make up a whole (the message says which)."""


@dataclass(frozen=True)
class Shard:
    index: int  # 1 ... count
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse(text: str) -> Shard:
    """``"2/3"`` as :class:`Shard` (2, 3); anything else is a :class:`ShardError` that says what is expected."""
    index, slash, count = str(text).strip().partition("/")
    try:
        shard = Shard(int(index), int(count))
    except ValueError:
        raise ShardError(f"--shard takes I/N, part I of N (e.g. 2/3), not {text!r}") from None
    if not slash or shard.count < 1 or not 1 <= shard.index <= shard.count:
        raise ShardError(f"--shard {text}: I/N needs 1 <= I <= N (e.g. 1/3, 2/3, 3/3)")
    return shard


def partition(units: Sequence[Unit], seconds: Mapping[Unit, float | None] | Callable[[Unit], float | None],
              count: int) -> tuple[list[list[Unit]], str]:
    """``units`` in ``count`` parts, and how they were balanced (:data:`BY_SECONDS` or :data:`BY_COUNT`).
    ``seconds``: each unit's recorded duration (``None`` or absent: unknown). Units must be distinct and
    sortable (their order breaks ties, so every machine cuts the same parts)."""
    if count < 1:
        raise ShardError(f"cannot cut work into {count} parts")
    if len(set(units)) != len(units):
        raise ShardError("a unit is listed twice; each must be in exactly one part")
    duration = seconds if callable(seconds) else seconds.get
    known = {unit: duration(unit) for unit in units}
    parts: list[list[Unit]] = [[] for _ in range(count)]
    if all(value is not None for value in known.values()):
        method = BY_SECONDS
        load = [0.0] * count
        for unit in sorted(units, key=lambda u: (-float(known[u]), u)):  # type: ignore[arg-type]
            k = min(range(count), key=lambda i: (load[i], len(parts[i]), i))
            parts[k].append(unit)
            load[k] += float(known[unit])  # type: ignore[arg-type]
    else:
        method = BY_COUNT
        for position, unit in enumerate(sorted(units)):  # type: ignore[type-var]
            parts[position % count].append(unit)
    order = {unit: position for position, unit in enumerate(units)}
    return [sorted(part, key=order.__getitem__) for part in parts], method


def part(units: Sequence[Unit], seconds: Mapping[Unit, float | None] | Callable[[Unit], float | None],
         shard: Shard) -> tuple[list[Unit], str]:
    """The units of ``shard`` (:func:`partition`'s part ``shard.index``) and how the parts were balanced."""
    parts, method = partition(units, seconds, shard.count)
    return parts[shard.index - 1], method


def digest(units: Sequence[object]) -> str:
    """A short name of a whole plan (its units, in any order): equal on every machine that planned the same."""
    return hashlib.sha256(json.dumps(sorted(json.dumps(u) for u in units)).encode()).hexdigest()[:16]


def check_complete(found: Mapping[int, Sequence[object]], count: int, whole: Sequence[object], what: str) -> None:
    """That ``found`` ({part number: its units}) are parts 1 ... ``count``, each once, that no unit is in two
    of them and that together they are ``whole``; else a :class:`ShardError` naming what is missing or twice."""
    missing = sorted(set(range(1, count + 1)) - set(found))
    if missing or set(found) - set(range(1, count + 1)):
        raise ShardError(f"{what}: parts {', '.join(f'{i}/{count}' for i in missing) or '(none)'} missing "
                         f"(got {', '.join(f'{i}/{count}' for i in sorted(found))}); merge all {count}")
    seen: dict[str, int] = {}
    for index, units in sorted(found.items()):
        for unit in units:
            key = json.dumps(unit)
            if key in seen:
                raise ShardError(f"{what}: {key} is in part {seen[key]}/{count} and in part {index}/{count}")
            seen[key] = index
    planned = {json.dumps(unit) for unit in whole}
    if set(seen) != planned:
        lost = sorted(planned - set(seen))[:5]
        extra = sorted(set(seen) - planned)[:5]
        raise ShardError(f"{what}: the parts do not make up the plan (in no part: {', '.join(lost) or 'none'}; "
                         f"not planned: {', '.join(extra) or 'none'})")
