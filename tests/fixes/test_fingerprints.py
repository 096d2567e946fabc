"""fixes.fingerprints: one value per source on every CPython 3.9–3.13, and the recorded values hold
for the installed releases."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from ci.sweep import fingerprints as tool
from ci import releases
from fixes import fingerprints
from fixes.registry import available
from tests.helpers import made_once

ROOT = Path(__file__).resolve().parents[2]
MODULE = ROOT / "fixes" / "fingerprints.py"
REQUIRED = ("3.11", "3.12")  # CI must have these; the others are checked where present
OPTIONAL = ("3.9", "3.10", "3.13")

SAMPLE = '''    def f(self, x, *, y=1):  # a comment
        """doc"""
        a = f"{x!r:>10} and {y + 1} {{literal}}"

        b = f"""multi
line {x}
"""
        c = f"nested {f'{x}'} done" "plain" rb'raw'
        if x != 1 and \\
                y:
            return [a, b, c][0] @ 3
        return None
'''


def interpreter(version: str) -> str | None:
    """A CPython ``version`` on this machine: pyenv's, then ``pythonX.Y`` on PATH."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob(f"{version}.*/bin/python3"), reverse=True):
        if candidate.is_file():
            return str(candidate)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(directory) / f"python{version}"
        if candidate.is_file():
            return str(candidate)
    return None


def fingerprints_under(python: str, sources: list[str]) -> list[str]:
    """``fingerprint_source`` of each source, computed by another interpreter (stdlib only)."""
    code = ("import json, runpy, sys; ns = runpy.run_path(sys.argv[1]); "
            "print(json.dumps([ns['fingerprint_source'](s) for s in json.load(sys.stdin)]))")
    done = subprocess.run([python, "-c", code, str(MODULE)], input=json.dumps(sources), capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout)


@pytest.fixture(scope="session")
def installed_targets(tmp_path_factory) -> tuple[tool.Observed, ...]:
    """Every entry's targets on every release of the release set (a process per release: read once per test run,
    :func:`tests.helpers.made_once`). The sweep's boundary releases are left to tests/ci/sweep/test_sweep.py, whose
    re-check applies each fix there: a fix whose targets' fingerprints are not the recorded ones refuses, and the
    recorded coverage ("fixed") then differs."""
    chosen = [r for r in releases.load().releases if releases.is_installed(r)]
    return made_once(tmp_path_factory, "installed-targets", lambda _: tuple(tool.observe_all(chosen, available())))


def test_when_only_comments_and_blank_lines_change_then_fingerprint_is_equal():
    plain = "def f(x):\n    return x\n"
    assert fingerprints.fingerprint_source(plain) == fingerprints.fingerprint_source(
        "def f(x):  # note\n\n    # more\n    return x\n")


def test_when_code_changes_then_fingerprint_differs():
    assert fingerprints.fingerprint_source(SAMPLE) != fingerprints.fingerprint_source(SAMPLE.replace("y + 1", "y + 2"))
    assert fingerprints.fingerprint_source(SAMPLE) != fingerprints.fingerprint_source(SAMPLE.replace("{x!r", "{x!s"))


def test_when_fstring_is_tokenised_then_it_is_one_string_token():
    kinds = [kind for kind, _ in fingerprints.tokens('x = f"a{b}c"\n')]
    assert kinds == ["NAME", "OP", "STRING", "NEWLINE", "ENDMARKER"]


@pytest.mark.parametrize("version", REQUIRED + OPTIONAL)
def test_when_computed_under_each_python_then_fingerprints_equal_this_one(version, installed_targets):
    python = interpreter(version)
    if python is None:
        if version in REQUIRED:
            pytest.fail(f"CPython {version} not found (pyenv or python{version} on PATH); CI must have it")
        pytest.skip(f"CPython {version} not found on this machine")
    sources = [SAMPLE] + [source for o in installed_targets for source in o.sources.values()]
    assert len(sources) > 1, "no installed release gave any target source"
    assert fingerprints_under(python, sources) == [fingerprints.fingerprint_source(s) for s in sources]


def test_when_a_release_is_recorded_then_its_installed_code_has_that_fingerprint(installed_targets):
    checked = 0
    for observed in installed_targets:
        recorded_here = any(observed.release in releases_ for known in fingerprints.recorded(observed.entry).values()
                            for releases_ in known.values())
        if not recorded_here and "DriftError" in observed.error:
            continue  # a release the fix refuses (its target missing or other code; the sweep records the refusal)
        assert not observed.error, f"{observed.entry}@{observed.release}: {observed.error}"
        for target, known in fingerprints.recorded(observed.entry).items():
            for fp, recorded_releases in known.items():
                if observed.release in recorded_releases:
                    assert observed.fingerprints.get(target) == fp, (observed.entry, target, observed.release)
                    checked += 1
    assert checked > 0


def test_when_record_is_merged_then_only_affected_releases_are_added():
    entry = "zero3-gathered-params-cpu-race"
    target = next(iter(fingerprints.recorded(entry)))
    observed = [tool.Observed("9.9.1", entry, True, {target: "aaaaaaaaaaaaaaaa"}),
                tool.Observed("9.9.2", entry, False, {target: "bbbbbbbbbbbbbbbb"})]
    merged = tool.merged(entry, observed)
    assert merged[target]["aaaaaaaaaaaaaaaa"] == ["9.9.1"]
    assert "bbbbbbbbbbbbbbbb" not in merged[target]
    assert set(fingerprints.recorded(entry)[target]) < set(merged[target])  # the old ones are kept
    assert list(tool.merged(entry, observed, replace=True)[target]) == ["aaaaaaaaaaaaaaaa"]


def test_when_entry_section_written_then_other_entries_are_kept(tmp_path):
    path = tmp_path / "fingerprints.json"
    fingerprints.write_entry("a", {"m.f": {"1111111111111111": ["0.1.0"]}}, path)
    fingerprints.write_entry("b", {"m.g": {"2222222222222222": ["0.2.0"]}}, path)
    assert fingerprints.recorded("a", path) == {"m.f": {"1111111111111111": ("0.1.0",)}}
    assert fingerprints.recorded("b", path) == {"m.g": {"2222222222222222": ("0.2.0",)}}
