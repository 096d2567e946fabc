"""The differential sweep's configuration space (``space.toml``): dimensions, their values, and the constraints
between values, read and checked once.

A *cell* is a complete assignment ``{dimension: value}``. :meth:`Space.allows` says whether a (partial) assignment
breaks no constraint; :meth:`Space.completable` whether some valid cell extends it (a depth-first search: the
constraints are few and local, so it answers at once)."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

SPACE_FILE = Path(__file__).with_name("space.toml")

Value = Any  # int | float | bool | str: what TOML holds
Cell = dict[str, Value]


class SpaceError(ValueError):
    """``space.toml`` is malformed (the message names the dimension or constraint)."""


@dataclass(frozen=True)
class Dimension:
    name: str
    values: tuple[Value, ...]
    why: str
    seen_in: str = ""
    unmodelled: Mapping[str, str] = field(default_factory=dict)  # value (as str) -> why its reference is missing

    @property
    def default(self) -> Value:
        return self.values[0]

    def why_unmodelled(self, value: Value) -> str:
        return self.unmodelled.get(str(value), "")


@dataclass(frozen=True)
class Constraint:
    when: Mapping[str, tuple[Value, ...]]
    require: Mapping[str, tuple[Value, ...]]
    why: str

    def broken_by(self, cell: Mapping[str, Value]) -> bool:
        """True where every ``when`` dimension is assigned and matches and an assigned ``require`` dimension does
        not hold an allowed value (an unassigned dimension breaks nothing yet)."""
        if any(name not in cell or not _member(cell[name], values) for name, values in self.when.items()):
            return False
        return any(name in cell and not _member(cell[name], values) for name, values in self.require.items())


def _member(value: Value, values: tuple[Value, ...]) -> bool:
    # TOML's true is not 1: compare with the type, so a bool never matches an int
    return any(type(value) is type(candidate) and value == candidate for candidate in values)


@dataclass(frozen=True)
class Space:
    dimensions: tuple[Dimension, ...]
    constraints: tuple[Constraint, ...]
    run: Mapping[str, Any]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dimensions)

    def dimension(self, name: str) -> Dimension:
        for dimension in self.dimensions:
            if dimension.name == name:
                return dimension
        raise KeyError(f"no dimension {name!r} in the space; known: {', '.join(self.names)}")

    def defaults(self) -> Cell:
        return {d.name: d.default for d in self.dimensions}

    def allows(self, cell: Mapping[str, Value]) -> bool:
        return not any(c.broken_by(cell) for c in self.constraints)

    def broken(self, cell: Mapping[str, Value]) -> list[Constraint]:
        return [c for c in self.constraints if c.broken_by(cell)]

    def completable(self, partial: Mapping[str, Value]) -> Cell | None:
        """A valid cell extending ``partial`` (each open dimension tried default first), or None."""
        if not self.allows(partial):
            return None
        open_ = [d for d in self.dimensions if d.name not in partial]
        cell = dict(partial)

        def search(index: int) -> bool:
            if index == len(open_):
                return True
            dimension = open_[index]
            for value in dimension.values:
                cell[dimension.name] = value
                if self.allows(cell) and search(index + 1):
                    return True
            del cell[dimension.name]
            return False

        return cell if search(0) else None

    def unmodelled(self, cell: Mapping[str, Value]) -> list[str]:
        """Why the reference cannot judge ``cell``: one line per value it does not model."""
        return [f"{name} {cell[name]}: {reason}" for name in self.names if name in cell
                for reason in [self.dimension(name).why_unmodelled(cell[name])] if reason]

    def check_cell(self, cell: Mapping[str, Value]) -> None:
        """Raise :class:`SpaceError` unless ``cell`` assigns every dimension a listed value and breaks no constraint."""
        if set(cell) != set(self.names):
            raise SpaceError(f"a cell assigns {sorted(set(self.names) ^ set(cell))} wrongly: it needs exactly the "
                             f"dimensions {', '.join(self.names)}")
        for name, value in cell.items():
            if not _member(value, self.dimension(name).values):
                raise SpaceError(f"{name} = {value!r} is not one of {list(self.dimension(name).values)}")
        broken = self.broken(cell)
        if broken:
            raise SpaceError(f"the cell breaks: {'; '.join(c.why for c in broken)}")


def load(path: Path = SPACE_FILE) -> Space:
    """Read and check the space: every dimension named once with at least two distinct values, a ``why``, and
    ``unmodelled`` keys among its values; every constraint naming known dimensions and values."""
    data = tomllib.loads(path.read_text())
    dimensions: list[Dimension] = []
    for raw in data.get("dimension", []):
        name = raw.get("name")
        values = tuple(raw.get("values", ()))
        if not name or len(values) < 2 or len({repr(v) for v in values}) != len(values):
            raise SpaceError(f"{path.name}: dimension {name!r} needs a name and two or more distinct values")
        if not raw.get("why"):
            raise SpaceError(f"{path.name}: dimension {name} says no `why`")
        unmodelled = dict(raw.get("unmodelled", {}))
        stray = sorted(set(unmodelled) - {str(v) for v in values})
        if stray:
            raise SpaceError(f"{path.name}: dimension {name} marks unknown values unmodelled: {stray}")
        dimensions.append(Dimension(name, values, raw["why"], raw.get("seen_in", ""), unmodelled))
    names = [d.name for d in dimensions]
    if len(set(names)) != len(names):
        raise SpaceError(f"{path.name}: a dimension is named twice: {names}")
    by_name = {d.name: d for d in dimensions}
    constraints = []
    for raw in data.get("constraint", []):
        parts = {key: {k: tuple(v) for k, v in raw.get(key, {}).items()} for key in ("when", "require")}
        for part in parts.values():
            for name, values in part.items():
                if name not in by_name:
                    raise SpaceError(f"{path.name}: a constraint names unknown dimension {name!r}")
                unknown = [v for v in values if not _member(v, by_name[name].values)]
                if unknown:
                    raise SpaceError(f"{path.name}: a constraint names values {unknown} that {name} does not have")
        if not parts["when"] or not parts["require"] or not raw.get("why"):
            raise SpaceError(f"{path.name}: a constraint needs `when`, `require` and `why`: {raw}")
        constraints.append(Constraint(parts["when"], parts["require"], raw["why"]))
    space = Space(tuple(dimensions), tuple(constraints), dict(data.get("run", {})))
    if space.completable({}) != space.defaults():
        raise SpaceError(f"{path.name}: the dimensions' defaults (first values) must make a valid cell")
    return space
