"""The record a notebook leaves for the runner: did the bug show, and did the fix verify.

The runner passes ``results_file`` as a papermill parameter; outside the runner it is empty and
the report only prints. The record is rewritten after every call, so a notebook that fails half
way still leaves what it established.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from ..files import write_atomic
from .compare import Comparison


@dataclass
class Report:
    entry: str
    results_file: str = ""
    environment: dict[str, Any] = field(default_factory=dict)
    affected: bool | None = None
    reproduced: dict[str, Any] | None = None
    fix_action: str | None = None
    verified: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def record_environment(self, environment: Any, affected: bool) -> None:
        self.environment = environment.as_dict() if hasattr(environment, "as_dict") else dict(environment)
        self.affected = affected
        self._write()

    def record_reproduced(self, kind: str, detail: str, max_abs_diff: float | None = None) -> None:
        """The bug showed: ``kind`` is "error" (``detail`` = the message) or "difference"."""
        self.reproduced = {"kind": kind, "detail": detail[:500], "max_abs_diff": max_abs_diff}
        self._write()

    def record_fix(self, outcome: Any) -> None:
        self.fix_action = getattr(outcome, "action", str(outcome))
        self._write()

    def record_verified(self, comparison: Comparison) -> None:
        self.verified.append({"name": comparison.name, "dtype": str(comparison.dtype).removeprefix("torch."),
                              "max_abs_diff": comparison.max_abs_diff, "close": comparison.close})
        self._write()

    def note(self, text: str) -> None:
        self.notes.append(text)
        self._write()

    @property
    def max_abs_diff_by_dtype(self) -> dict[str, float]:
        """The largest difference verified after the fix, per dtype."""
        largest: dict[str, float] = {}
        for check in self.verified:
            largest[check["dtype"]] = max(largest.get(check["dtype"], 0.0), check["max_abs_diff"])
        return largest

    def _write(self) -> None:
        if not self.results_file:
            return
        write_atomic(self.results_file, json.dumps(asdict(self), indent=2, default=str))


def print_table(rows: list[dict[str, Any]]) -> None:
    """Print rows (dicts with the same keys) as an aligned text table."""
    if not rows:
        print("(no rows)")
        return
    columns = list(rows[0])
    widths = {c: max(len(str(c)), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(str(c).ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
