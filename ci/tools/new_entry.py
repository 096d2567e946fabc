"""Scaffold a new entry: its fix package, its notebook and its own test folder, and nothing else.

    python -m ci.tools.new_entry SLUG --release 0.18.9 [--title "..."] [--component ZeRO-1/2 ...]

Writes these six files (:func:`paths`), refuses to overwrite any, and edits no file outside the entry's own three
folders:

* ``fixes/entries/<slug_>/info.toml`` — every fact about the bug, once (the fields of ``FixInfo``);
* ``fixes/entries/<slug_>/__init__.py`` — the fix: its ``targets``, ``read_code()`` and ``patches()``;
* ``fixes/entries/<slug_>/reproduce.py`` — ``reproduce()``, the check the release sweep runs, and
  ``trigger_cells()``, the grid its trigger is measured on;
* ``fixes/entries/<slug_>/trigger.py`` — ``TRIGGER``, the jobs that hit the bug;
* ``notebooks/<slug>.ipynb`` — title, Colab cell, parameters, the entry card, the six sections;
* ``tests/fixes/entries/<slug_>/test_fix.py`` — only what is specific to this entry: every check every entry
  must pass (metadata, probe against the sweep, apply/revert, drift, no-op, trigger, notebook selection) is
  ``tests/fixes/test_contract.py``'s, which finds the entry through the registry with nothing to add.

Every ``TODO`` in them fails loudly until it is done (the fix raises, the notebook asserts, the contract finds no
trigger), so a half-filled entry cannot pass. The tools then write the records (fingerprints, sweep rows, trigger
grid, notebook runs, claim references): see ``docs/contributing.md``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import nbformat

from .. import ROOT

SLUG = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")


def paths(slug: str, root: Path = ROOT) -> dict[str, Path]:
    """Every file the scaffold writes for ``slug``: the whole of a new entry's hand-written part."""
    package = slug.replace("-", "_")
    return {
        "info": root / "fixes" / "entries" / package / "info.toml",
        "fix": root / "fixes" / "entries" / package / "__init__.py",
        "reproduce": root / "fixes" / "entries" / package / "reproduce.py",
        "trigger": root / "fixes" / "entries" / package / "trigger.py",
        "notebook": root / "notebooks" / f"{slug}.ipynb",
        "test": root / "tests" / "fixes" / "entries" / package / "test_fix.py",
    }


def folders(slug: str, root: Path = ROOT) -> list[Path]:
    """The entry's own folders, the only places a new entry's files go (the tools' records aside)."""
    return sorted({path.parent for path in paths(slug, root).values()})


def info_source(slug: str, release: str, title: str, components: list[str]) -> str:
    listed = ", ".join(json.dumps(c) for c in components)
    return f'''# Every fact about {slug}, once: the fields of fixes.fix.FixInfo (read by its Fix class). No release range or
# measured count: the sweep measures those, and the card shows them.
id = "{slug}"
title = {json.dumps(title)}  # no release numbers: the card shows the measured range
summary = "TODO: what the user sees, in one paragraph, without release numbers."
symptom = "silent wrong result"  # or "crash", "hang"
kind = "bug"  # or "behaviour change": an intended upstream change; fixes.apply() applies it only by name
components = [{listed}]
error_signatures = ["TODO: the exact error text users paste"]
root_cause = "TODO: deepspeed/<file>.py, Class.method: why it goes wrong."
reproduce_release = "{release}"
# upstream_fixed_in = "0.x.y"  # what upstream says; the sweep measures the range
upstream_issues = []
upstream_prs = []
'''


def fix_source(slug: str, release: str, title: str, components: list[str]) -> str:
    cls = "".join(part.capitalize() for part in slug.split("-"))
    return f'''"""{title}.

How the fix works, for the next developer (the bug itself is described once, in ``info.toml``).
"""
from __future__ import annotations

from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target

_TARGET = Target("deepspeed.TODO.module", "TODOClass.todo_method")  # TODO: the DeepSpeed code the fix replaces


class {cls}(Fix):
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


def trigger_cells() -> list:
    """TODO: the trigger's grid (``fixes.harness.Cell``): the job with every condition of ``trigger.TRIGGER`` (it
    must reproduce), then one cell per condition flipped on its own; ``python -m ci.sweep.triggers --entry {slug}``
    measures it."""
    raise NotImplementedError("TODO: {slug} trigger cells")
'''


def trigger_source(slug: str) -> str:
    return f'''"""The jobs that hit {slug}'s bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``."""
from ...trigger import Trigger  # noqa: F401 - and the conditions it needs: stage, precision, gas, uses, ...

TRIGGER = None  # TODO: Trigger(...), every condition of which must hold; until then the contract says "no trigger"
'''


def test_source(slug: str, release: str) -> str:
    package = slug.replace("-", "_")
    return f'''"""What is specific to {slug}, in child processes of a release (``call_in_release``). Every check every
entry must pass (metadata, probe against the sweep, apply/revert exact, drift refused, no-op where unaffected, its
trigger and notebook) is tests/fixes/test_contract.py's: it runs on this entry with nothing written here."""
from tests.helpers import call_in_release

AFFECTED = "{release}"
FIX_ID = "{slug}"


def check_the_fix_matches_plain_pytorch():
    """TODO: what the contract does not check: e.g. the user's job with the fix against plain PyTorch under the
    dtype's tolerance, each configuration the trigger names, how it composes with a related entry's fix."""
    import fixes
    from fixes import harness  # noqa: F401 - the usual tools

    harness.setup()
    assert fixes.get(FIX_ID).probe().affected
    raise AssertionError("TODO: {slug}'s own checks")


def test_when_the_fix_is_applied_then_the_job_matches_plain_pytorch():
    call_in_release(AFFECTED, check_the_fix_matches_plain_pytorch)
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
    texts = {"info": info_source(slug, release, title, components),
             "fix": fix_source(slug, release, title, components), "reproduce": reproduce_source(slug),
             "trigger": trigger_source(slug), "test": test_source(slug, release)}
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
    print(f"edited nothing else; the entry's own folders: {', '.join(str(f.relative_to(ROOT)) for f in folders(args.slug))}")
    print(f"next: fill the TODOs, then `python -m ci.notebooks.colab sync`, `python -m ci.sweep.fingerprints {args.slug} --write`, "
          f"`python -m ci.sweep --entry {args.slug}`, `python -m ci.sweep.triggers --entry {args.slug}`, "
          f"`python -m ci.notebooks.runner --entry {args.slug} --record`, `python -m ci.notebooks.claims refresh`")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
