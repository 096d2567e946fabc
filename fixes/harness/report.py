"""The record a notebook leaves for the runner (a :class:`fixes.record.RunRecord`): did the bug
show, and did the fix verify.

The runner passes ``results_file`` as a papermill parameter; outside the runner it is empty and
the report only prints. The record is rewritten after every call, so a notebook that fails half
way still leaves what it established.
"""
from __future__ import annotations

import json
from typing import Any

from ..files import write_atomic
from ..record import Check, Reproduction, RunRecord
from .compare import Comparison


class Report:
    """Writes one notebook run's :class:`~fixes.record.RunRecord` to ``results_file``."""

    def __init__(self, entry: str, results_file: str = "") -> None:
        self.record = RunRecord(entry)
        self.results_file = results_file

    def record_environment(self, environment: Any, affected: bool) -> None:
        self.record.environment = environment.as_dict() if hasattr(environment, "as_dict") else dict(environment)
        self.record.affected = affected
        self._write()

    def record_reproduced(self, kind: str, detail: str, max_abs_diff: float | None = None) -> None:
        """The bug showed: ``kind`` is "error" (``detail`` = the message) or "difference"."""
        self.record.reproduced = Reproduction(kind, detail[:500], max_abs_diff)  # type: ignore[arg-type]
        self._write()

    def record_fix(self, outcome: Any) -> None:
        self.record.fix_action = getattr(outcome, "action", str(outcome))
        self._write()

    def record_verified(self, comparison: Comparison) -> None:
        self.record.verified.append(Check(comparison.name, str(comparison.dtype).removeprefix("torch."),
                                          comparison.max_abs_diff, comparison.close))
        self._write()

    def note(self, text: str) -> None:
        self.record.notes.append(text)
        self._write()

    @property
    def max_abs_diff_by_dtype(self) -> dict[str, float]:
        return self.record.max_abs_diff_by_dtype

    def _write(self) -> None:
        from .env import RANK_DEVICES

        self.record.rank_devices = sorted(RANK_DEVICES)
        if not self.results_file:
            return
        write_atomic(self.results_file, json.dumps(self.record.to_json(), indent=2, default=str))


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


def show_code(function: Any) -> str:
    """Show a function's source in the notebook (as a Python block; printed elsewhere): the user's
    script that an entry runs in its ranks, so the notebook shows the lines that trigger the bug."""
    import inspect

    source = inspect.getsource(function)
    try:
        from IPython.display import Markdown, display
    except ImportError:
        print(source)
    else:
        display(Markdown(f"```python\n{source}```"))
    return source
