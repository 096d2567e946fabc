"""The differential sweep's sample for the test suite: a deterministic handful of the record's rows, measured again
and compared with what the record says (the full grid runs in ``python -m ci.differential`` and the workflow).

The sample: for every entry that explains a recorded row, one such row (its first release, then the smallest cell
id; a cell the attribution found flaky on any release is left out), run as it was (its recorded verdict again) and with the entry's fixes applied (it agrees again); and the first
``agreeing`` cells by id that agree on the newest recorded release, run again there.
"""
from __future__ import annotations

from dataclasses import dataclass

from fixes.versions import parse

from . import record as record_module

AGREEING = 3


@dataclass(frozen=True)
class Check:
    cell: str
    release: str
    apply: tuple[str, ...]  # the fixes applied for the run (empty: as recorded)
    expected: str  # the verdict the run must give

    @property
    def key(self) -> str:
        return f"{self.cell}+{'+'.join(self.apply)}" if self.apply else self.cell


def sample(data: record_module.Record, agreeing: int = AGREEING) -> list[Check]:
    checks: list[Check] = []
    explained: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for cell_id, by_release in sorted(data.attribution.items()):
        if any(found.get("status") == "flaky" for found in by_release.values()):
            continue  # seen to flip on some release: measured again, it need not give its verdict
        for release, found in by_release.items():
            if found.get("status") != "explained":
                continue
            for entry in found["entries"]:
                here = (release, cell_id, tuple(found["entries"]))
                if entry not in explained or (parse(release), cell_id) < (parse(explained[entry][0]), explained[entry][1]):
                    explained[entry] = here
    for release, cell_id, entries in sorted(set(explained.values()), key=lambda x: (parse(x[0]), x[1])):
        checks.append(Check(cell_id, release, (), data.rows[cell_id][release]["verdict"]))
        checks.append(Check(cell_id, release, entries, "agrees"))
    if data.releases:
        newest = data.releases[-1]
        agree = sorted(c for c in data.rows if data.rows[c].get(newest, {}).get("verdict") == "agrees")
        checks += [Check(c, newest, (), "agrees") for c in agree[:agreeing]]
    return checks
