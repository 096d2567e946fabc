"""The differential sweep's sample, measured again on CPU and compared with the record: each entry's explained row
still differs (or crashes) as recorded and agrees with the entry's fix applied; a few agreeing cells still agree."""
from __future__ import annotations

import time

from ci import differential
from ci.differential import record as record_module
from ci.differential import sample as sample_module
from ci.differential import space as space_module


def test_when_the_record_is_sampled_then_each_explaining_entry_and_a_few_agreeing_cells_are_in_it():
    data = record_module.read()
    checks = sample_module.sample(data)
    def flaky(cell: str) -> bool:  # seen to flip on some release: no deterministic check
        return any(a.get("status") == "flaky" for a in data.attribution.get(cell, {}).values())

    explaining = {e for cell, by_release in data.attribution.items() if not flaky(cell) for a in by_release.values()
                  if a.get("status") == "explained" for e in a["entries"]}
    assert explaining <= {e for c in checks for e in c.apply}
    assert not any(flaky(c.cell) for c in checks)
    assert sum(c.release == data.releases[-1] and not c.apply and c.expected == "agrees" for c in checks) >= 1
    assert checks == sample_module.sample(data)  # deterministic


def test_when_the_sample_is_measured_again_then_every_row_gives_its_recorded_verdict():
    data = record_module.read()
    run = dict(space_module.load().run)
    checks = sample_module.sample(data)
    started = time.process_time(), time.monotonic()
    got = {}
    for release in sorted({c.release for c in checks}):
        items = {c.key: {"cell": data.cells[c.cell]["cell"], "apply": list(c.apply)}
                 for c in checks if c.release == release}
        answers, failure = differential.run_child(release, items, run, 120 * len(items) + 60, 120)
        assert not failure, failure
        got.update({(release, key): answer for key, answer in answers.items()})
    wrong = [(c, got.get((c.release, c.key))) for c in checks
             if (got.get((c.release, c.key)) or {}).get("verdict") != c.expected]
    print(f"differential sample: {len(checks)} runs in {time.monotonic() - started[1]:.0f} s wall")
    assert not wrong, wrong
