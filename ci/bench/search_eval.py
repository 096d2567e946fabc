"""How well ``fixbook search`` finds an entry from real users' words: the labelled reports of
``tests/fixes/data/user_reports.json`` (error lines and prose copied from upstream and downstream threads, each with
its source), split once into a tuned part and a held-out part that the ranking is never tuned on.

    python -m ci.bench.search_eval      # the figures, and every miss

The split is by thread (the report's source), so reports of one thread sit on one side: a held-out report shares
no thread with a tuned one.
"""
from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import ROOT

REPORTS = ROOT / "tests" / "fixes" / "data" / "user_reports.json"
HELD_OUT_SHARE = 3  # of 10: threads whose source hashes to 0, 1 or 2 (mod 10)


def is_held_out(report: dict) -> bool:
    return int(hashlib.sha256(report["source"].encode()).hexdigest(), 16) % 10 < HELD_OUT_SHARE


@dataclass
class Figures:
    """One part's result: top-1 right of the entries' reports, strong answers on the negatives."""

    right: int = 0
    reports: int = 0
    strong_negatives: int = 0
    negatives: int = 0
    misses: list[str] = field(default_factory=list)
    strong: list[str] = field(default_factory=list)

    @property
    def top1(self) -> float:
        return self.right / self.reports if self.reports else 0.0

    def line(self, name: str) -> str:
        return (f"{name}: top-1 right on {self.right} of {self.reports} reports ({self.top1:.0%}); strong answer on "
                f"{self.strong_negatives} of {self.negatives} unrelated reports")


def evaluate(path: Path = REPORTS) -> dict[str, Figures]:
    """The figures of the tuned part, the held-out part and both together, and the time each query took."""
    from fixes.cli import search

    parts = {"tuned": Figures(), "held-out": Figures(), "all": Figures()}
    for report in json.loads(path.read_text())["reports"]:
        found = search(report["text"])
        for part in ("held-out" if is_held_out(report) else "tuned", "all"):
            figures = parts[part]
            if report["entry"]:
                figures.reports += 1
                top = found[0].fix_id if found else None
                if top == report["entry"]:
                    figures.right += 1
                else:
                    figures.misses.append(f"{report['entry']} ({report['kind']}) got {top}: {report['text'][:90]!r}")
            else:
                figures.negatives += 1
                strong = [m.fix_id for m in found if m.level == "strong"]
                if strong:
                    figures.strong_negatives += 1
                    figures.strong.append(f"{strong[0]}: {report['text'][:90]!r}")
    return parts


def query_times_ms(texts: list[str], rounds: int = 3) -> list[float]:
    """Each text's search time in ms, the best of ``rounds`` (the registry and indexes made beforehand)."""
    from fixes.cli import search

    search(texts[0])
    times = []
    for text in texts:
        best = float("inf")
        for _ in range(rounds):
            started = time.perf_counter()
            search(text)
            best = min(best, time.perf_counter() - started)
        times.append(best * 1e3)
    return times


def main() -> int:
    parts = evaluate()
    for name, figures in parts.items():
        print(figures.line(name))
    for miss in parts["all"].misses:
        print("  miss:", miss)
    for strong in parts["all"].strong:
        print("  strong on an unrelated report:", strong)
    texts = [r["text"] for r in json.loads(REPORTS.read_text())["reports"]]
    print(f"median {statistics.median(query_times_ms(texts)):.2f} ms per query over {len(texts)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
