"""Scaffold a new entry: its fix package, its notebook and its tests, and nothing else.

    python -m ci.tools.new_entry SLUG --release 0.18.9 [--title "..."] [--component ZeRO-1/2 ...]

Writes (and refuses to overwrite):

* ``fixes/entries/<slug_>/__init__.py`` — the fix: ``FixInfo`` (every fact about the bug, once),
  its ``targets``, ``read_code()`` and ``patches()``;
* ``fixes/entries/<slug_>/reproduce.py`` — ``reproduce()``, the check the release sweep runs;
* ``notebooks/<slug>.ipynb`` — title, Colab cell, parameters, the entry card, the six sections;
* ``tests/fixes/entries/<slug_>/test_fix.py`` — apply/revert/drift on a real affected release and a
  no-op on a fixed one.

Every ``TODO`` in them fails loudly until it is done (the fix raises, the notebook asserts), so a
half-filled entry cannot pass. Then record fingerprints (``python -m ci.sweep.fingerprints``), sweep
(``python -m ci.sweep --entry``), and run the notebook (``python -m ci.notebooks.runner --entry``): see
``docs/contributing.md``.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

from .. import ROOT

SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def paths(slug: str, root: Path = ROOT) -> dict[str, Path]:
    package = slug.replace("-", "_")
    return {
        "fix": root / "fixes" / "entries" / package / "__init__.py",
        "reproduce": root / "fixes" / "entries" / package / "reproduce.py",
        "notebook": root / "notebooks" / f"{slug}.ipynb",
        "test": root / "tests" / "fixes" / "entries" / package / "test_fix.py",
    }


def fix_source(slug: str, release: str, title: str, components: list[str]) -> str:
    cls = "".join(part.capitalize() for part in slug.split("-"))
    return f'''"""{title}.

How the fix works, for the next developer (the bug itself is described once, in ``info`` below).
"""
from __future__ import annotations

from typing import Any

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.TODO.module", "TODOClass.todo_method")  # TODO: the DeepSpeed code the fix replaces


class {cls}(Fix):
    info = FixInfo(
        id="{slug}",
        title="{title}",  # no release numbers: the card shows the measured range
        summary="TODO: what the user sees, in one paragraph, without release numbers.",
        symptom="silent wrong result",  # or "crash", "hang"
        kind="bug",  # or "behaviour change": an intended upstream change; fixes.apply() applies it only by name
        components=({", ".join(repr(c) for c in components)},),
        error_signatures=("TODO: the exact error text users paste",),
        root_cause="TODO: deepspeed/<file>.py, Class.method: why it goes wrong.",
        reproduce_release="{release}",
        upstream_fixed_in=None,  # what upstream says; the sweep measures the range
        upstream_issues=(),
        upstream_prs=(),
    )
    targets = (_TARGET,)

    def read_code(self) -> Probe:
        """Read the installed code (not only the version) and say whether the bug is in it."""
        raise NotImplementedError("TODO: {slug}.read_code")

    def patches(self) -> list[AttributePatch]:
        return [_TARGET.wrap(_fixed)]


def _fixed(original: Any) -> Any:
    """The replacement for the target (``functools.wraps`` it, keep ``__wrapped__``)."""
    raise NotImplementedError("TODO: {slug} replacement")


FIX = {cls}()
'''


def reproduce_source(slug: str) -> str:
    return f'''"""How {slug} is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never
by the fix or its probe."""
from __future__ import annotations

from ...exceptions import CannotTellError


def reproduce() -> bool:
    """TODO: the user's job in seconds (``fixes.harness``), against plain PyTorch or the exact error:
    True if the bug shows, False if not; raise CannotTellError if the run fails in a way that says
    nothing about the bug."""
    from ...harness import Job, versus_reference  # noqa: F401 - the usual tools

    raise CannotTellError("TODO: {slug} has no reproduction yet")
'''


def test_source(slug: str, release: str) -> str:
    package = slug.replace("-", "_")
    return f'''"""{slug} on its affected release and on the newest (fixed?) one, in child processes."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, call_in_release)

AFFECTED = "{release}"
FIX_ID = "{slug}"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.{package} import _TARGET

    return _TARGET.owner_and_name()[0]


def check_protocol_on_affected_release():
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, _owner())


def check_reproduces_then_the_fix_repairs_it():
    import fixes
    from fixes.entries.{package}.reproduce import reproduce

    _owner()
    assert reproduce() is True
    fixes.apply(FIX_ID)
    assert reproduce() is False
    fixes.revert(FIX_ID)


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.{package} import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, lambda *args, **kwargs: None)


def check_fixed_release_is_a_noop():
    assert_noop_on_fixed_release(FIX_ID, _owner())


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_the_reproduction_no_longer_shows_the_bug():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_repairs_it)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
'''


def notebook(slug: str, title: str) -> nbformat.NotebookNode:
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    cells = [
        md(f"# {title}"),
        code("# written by `python -m ci.notebooks.colab sync`", metadata={"tags": ["colab-setup"]}),
        code('# Parameters (papermill injects values after this cell)\n'
             'results_file = ""  # where the runner wants this run\'s record; empty: print only\n'
             'dtypes = ["float32", "bfloat16"]\nsteps = 2', metadata={"tags": ["parameters"]}),
        code(f'import fixes.card\n\nfixes.card.show("{slug}")  # the entry card: stated once in the `fixes` package, '
             'measured by the sweep', metadata={"tags": ["entry-card"]}),
        md("## Symptom\n\nTODO: what the user sees, in their words (no release numbers: the card has the measured "
           "range)."),
        md("## Environment\n\nRuns on CPU (`DS_ACCELERATOR=cpu`, one gloo process) and on CUDA when present."),
        code(f'import fixes\nfrom fixes import harness\n\nentry = harness.begin("{slug}", results_file)\n'
             'FIX, env, probe, report = entry.fix, entry.env, entry.probe, entry.report'),
        md("## Reproduce\n\nThe user's script: the DeepSpeed config and the lines that trigger the bug."),
        code("import deepspeed\nimport torch\n\nconfig = {  # TODO: the config that triggers the bug\n"
             '    "train_micro_batch_size_per_gpu": 4,\n    "zero_optimization": {"stage": 2},\n}\n'
             "# TODO: deepspeed.initialize(...) and the training loop, as a user writes them\n"
             'raise AssertionError("TODO: reproduce the bug and record it with report.record_reproduced")'),
        md("## Root cause\n\nTODO: `deepspeed/<file>.py`, `Class.method`: the lines, and why."),
        md("## Fix"),
        code("[outcome] = fixes.apply(FIX.id)\nprint(outcome)\nreport.record_fix(outcome)\n"
             'assert outcome.action == ("applied" if probe.affected else "not needed"), outcome',
             metadata={"tags": ["nbval-check-output"]}),  # a claim: what the fix patched (ci.notebooks.claims)
        md("## Verify\n\nAgainst plain PyTorch, per dtype with `harness.TOLERANCES`."),
        code('raise AssertionError("TODO: harness.assert_close against the plain-PyTorch reference, '
             'report.record_verified(...)")'),
        md("## Revert"),
        code("print(fixes.revert(FIX.id)[0])\nassert not FIX.applied and FIX.probe().affected == probe.affected",
             metadata={"tags": ["nbval-check-output"]}),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def scaffold(slug: str, release: str, title: str, components: list[str], root: Path = ROOT) -> dict[str, Path]:
    """Write the entry's files under ``root``; raise FileExistsError (writing nothing) if any exists."""
    if not SLUG.match(slug):
        raise ValueError(f"{slug!r} is not a slug: lower-case words joined by '-'")
    targets = paths(slug, root)
    existing = [str(p) for p in targets.values() if p.exists()]
    if existing:
        raise FileExistsError(f"entry {slug} already has {', '.join(existing)}")
    texts = {"fix": fix_source(slug, release, title, components), "reproduce": reproduce_source(slug),
             "test": test_source(slug, release)}
    for key, text in texts.items():
        targets[key].parent.mkdir(parents=True, exist_ok=True)
        targets[key].write_text(text)
    targets["notebook"].parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook(slug, title), targets["notebook"])
    return targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.tools.new_entry", description=__doc__.splitlines()[0])
    parser.add_argument("slug", help="the entry id, e.g. zero2-grad-accum-last-microbatch")
    parser.add_argument("--release", required=True, help="the DeepSpeed release that reproduces it")
    parser.add_argument("--title", default="TODO: what goes wrong, in the words of the error or the symptom")
    parser.add_argument("--component", action="append", default=[], help="repeatable, e.g. ZeRO-1/2")
    args = parser.parse_args(argv)
    try:
        written = scaffold(args.slug, args.release, args.title, args.component or ["TODO"])
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for path in written.values():
        print(f"wrote {path.relative_to(ROOT)}")
    print(f"next: fill the TODOs, then `python -m ci.notebooks.colab sync`, `python -m ci.sweep.fingerprints {args.slug} --write`, "
          f"`python -m ci.sweep --entry {args.slug}`, `python -m ci.notebooks.runner --entry {args.slug}`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
