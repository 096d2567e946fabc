"""Minimising the differential sweep's unexplained findings: the smallest configuration that still shows a
difference, and the releases it shows on.

An unexplained (cell, release) row is grouped with the other unexplained rows of its cell that fail the same way
(:func:`signature`: the verdict and the first quantity that differs, or the exception's type). Each group is
minimised on its newest release (:func:`minimise`): every dimension the cell sets away from its default
(``space.toml``'s first value) is moved to its default, all such moves at once in one child; the moves after which
the signature persists are kept (together, checked once more; one at a time where together they lose it), and the
search repeats from the smaller cell until no move keeps the signature. The minimal cell is then run on every
release (the sweep's), which gives the first and the last release it shows on: a range read from rows, not
assumed contiguous.

    {"minimised": {KEY: {"cell": CELL_ID, "signature": "differs: parameters", "rows": [RELEASE, ...],
                         "on": RELEASE, "minimal": {dimension: value}, "set": {dimension: value},
                         "tries": [{"moves": [...], "kept": [...]}, ...],
                         "releases": {RELEASE: "differs: parameters" | "agrees" | ...},
                         "first": RELEASE, "last": RELEASE,
                         "script": {"name": FILE, "run": {...}, "checked": {RELEASE: VERDICT}, "matches": BOOL}}}}

``KEY`` is ``CELL_ID~N`` (N: the group's index in the cell, newest group first). ``script``: the minimal cell as a
standalone script a user can file upstream (:mod:`fixes.harness.standalone`), run on :func:`script_releases` (the
newest release it fails on, and the newest it agrees on) with the verdict it printed on each; ``matches``: each is
the verdict the sweep recorded for the minimal cell there.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from fixes.versions import parse

from .space import Space

Cell = dict[str, Any]
RunCells = Callable[[dict[str, Cell]], dict[str, dict[str, Any]]]  # {key: cell} -> {key: row}, one release
MINIMISED = ("differs", "crashes")


def signature(row: Mapping[str, Any]) -> str:
    """How a row fails: ``differs: QUANTITY`` (the first quantity outside tolerance), ``crashes: EXCEPTION TYPE``,
    or the verdict alone (agrees, rejected, could not run)."""
    verdict = row.get("verdict", "could not run")
    if verdict == "differs":
        return f"differs: {row.get('quantity', '?')}"
    if verdict == "crashes":
        return f"crashes: {str(row.get('error', '')).split(':', 1)[0].strip() or '?'}"
    return verdict


@dataclass
class Group:
    """The unexplained rows of one cell that fail the same way."""

    key: str
    cell_id: str
    signature: str
    releases: list[str]  # oldest first

    @property
    def newest(self) -> str:
        return self.releases[-1]


def groups(rows: Mapping[str, Mapping[str, Mapping[str, Any]]],
           attribution: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> list[Group]:
    """Every cell's unexplained differing/crashing rows, grouped by :func:`signature` (newest group first in a
    cell); cells in id order."""
    found: list[Group] = []
    for cell_id in sorted(attribution):
        by_signature: dict[str, list[str]] = {}
        for release, verdict in attribution[cell_id].items():
            row = rows.get(cell_id, {}).get(release)
            if verdict.get("status") == "unexplained" and row and row.get("verdict") in MINIMISED:
                by_signature.setdefault(signature(row), []).append(release)
        ordered = sorted(by_signature.items(), key=lambda item: parse(max(item[1], key=parse)), reverse=True)
        for index, (sig, releases) in enumerate(ordered):
            found.append(Group(f"{cell_id}~{index}", cell_id, sig, sorted(releases, key=parse)))
    return found


def moves(cell: Mapping[str, Any], space: Space) -> list[str]:
    """The dimensions ``cell`` sets away from their defaults, in the space's order."""
    defaults = space.defaults()
    return [name for name in space.names if cell.get(name, defaults[name]) != defaults[name]]


def moved(cell: Mapping[str, Any], names: list[str], space: Space) -> Cell:
    defaults = space.defaults()
    return {**cell, **{name: defaults[name] for name in names}}


@dataclass
class Minimised:
    minimal: Cell
    tries: list[dict[str, Any]] = field(default_factory=list)

    def set_values(self, space: Space) -> Cell:
        """The minimal cell's values away from their defaults: what a user must set to see it."""
        return {name: self.minimal[name] for name in moves(self.minimal, space)}


def minimise(cell: Mapping[str, Any], wanted: str, run: RunCells, space: Space, rounds: int = 8,
             known: Callable[[Cell], list[str]] | None = None) -> Minimised:
    """The smallest cell reached from ``cell`` by moving dimensions to their defaults while the rows keep the
    signature ``wanted`` (see the module's docstring). ``run`` measures cells on the group's release. A move that
    breaks one of the space's constraints is not tried. ``known``: the entries that could explain a cell on that
    release (trigger and measured range); a move that brings one ``cell`` does not have would slide onto a known
    bug, which may fail the same way, so it is not tried either (``tries`` names it)."""
    current: Cell = dict(cell)
    tries: list[dict[str, Any]] = []
    unexplained = set(known(current)) if known else set()
    for _ in range(rounds):
        candidates = {name: moved(current, [name], space) for name in moves(current, space)}
        candidates = {name: c for name, c in candidates.items() if space.allows(c)}
        if known:
            slides = {name: sorted(set(known(c)) - unexplained) for name, c in candidates.items()}
            slides = {name: entries for name, entries in slides.items() if entries}
            if slides:
                tries.append({"moves": sorted(slides), "kept": [],
                              "seen": {name: "slides onto " + ", ".join(e) for name, e in slides.items()}})
            candidates = {name: c for name, c in candidates.items() if name not in slides}
        if not candidates:
            break
        answers = run(candidates)
        kept = [name for name in candidates if signature(answers.get(name, {})) == wanted]
        tries.append({"moves": sorted(candidates), "kept": kept,
                      "seen": {name: signature(answers.get(name, {})) for name in candidates}})
        if not kept:
            break
        if len(kept) == 1:
            current = candidates[kept[0]]
            continue
        together = moved(current, kept, space)
        if space.allows(together) and not (known and set(known(together)) - unexplained):
            answer = run({"together": together}).get("together", {})
            tries.append({"moves": ["together: " + ", ".join(kept)], "kept": kept if signature(answer) == wanted else [],
                          "seen": {"together": signature(answer)}})
            if signature(answer) == wanted:
                current = together
                continue
        current = candidates[kept[0]]  # together they lose it: one move at a time
    return Minimised(current, tries)


def release_range(by_release: Mapping[str, str], wanted: str) -> tuple[str | None, str | None]:
    """(first, last) release whose row shows ``wanted``."""
    showing = sorted((r for r, sig in by_release.items() if sig == wanted), key=parse)
    return (showing[0], showing[-1]) if showing else (None, None)


VERDICT_LINE = "verdict: "


def script_releases(found: Mapping[str, Any]) -> list[str]:
    """Where a group's script is run to check it: the newest release its minimal cell fails on with the group's
    signature, and the newest release it agrees on (if any)."""
    by_release = found.get("releases", {})
    failing = [r for r, sig in by_release.items() if sig == found.get("signature")]
    agreeing = [r for r, sig in by_release.items() if sig == "agrees"]
    return [max(chosen, key=parse) for chosen in (failing, agreeing) if chosen]


def printed_verdict(stdout: str) -> str:
    """The verdict a standalone script printed (its last ``verdict: ...`` line), or "no verdict"."""
    lines = [line[len(VERDICT_LINE):].strip() for line in stdout.splitlines() if line.startswith(VERDICT_LINE)]
    return lines[-1] if lines else "no verdict"


# A rank process that died: the sweep's launcher says RankFailedError, a script's torch.multiprocessing says
# ProcessExitedException. The same outcome in two words.
RANK_DIED = ("crashes: RankFailedError", "crashes: ProcessExitedException")


def same_outcome(printed: str, recorded: str | None) -> bool:
    """Whether a script's verdict is the one the sweep recorded (a rank that died counts the same either way)."""
    return printed == recorded or (printed in RANK_DIED and recorded in RANK_DIED)
