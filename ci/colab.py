"""The Colab entry point of every notebook: a first cell that, on Colab only, installs the
DeepSpeed release the entry reproduces on and the ``fixes`` package from the repository.

The repository URL has one home, ``repo_url`` in ``mkdocs.yml``; notebooks are stored with the
cell written out (Colab opens them straight from the repository), so ``sync`` rewrites it from
that setting and the registry, and the tests fail while any notebook is out of date.

    python -m ci.colab sync     # rewrite the cell in every notebook
    python -m ci.colab check    # exit 1 if any notebook is out of date
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

import fixes

from . import ROOT
NOTEBOOKS = ROOT / "notebooks"
TAG = "colab-setup"


def repo_url(mkdocs_yml: Path = ROOT / "mkdocs.yml") -> str:
    """``repo_url`` from mkdocs.yml (read as text: the file has tags PyYAML's safe loader refuses)."""
    match = re.search(r"^repo_url:\s*(\S+)\s*$", mkdocs_yml.read_text(), re.MULTILINE)
    if not match:
        raise ValueError(f"{mkdocs_yml} has no repo_url setting")
    return match.group(1).rstrip("/")


def colab_url(entry: str, url: str | None = None) -> str:
    url = url or repo_url()
    path = url.removeprefix("https://github.com/")
    return f"https://colab.research.google.com/github/{path}/blob/main/notebooks/{entry}.ipynb"


def setup_source(entry: str, url: str | None = None) -> str:
    release = fixes.get(entry).info.reproduce_release
    url = url or repo_url()
    return f'''# Colab only: install the DeepSpeed release this entry reproduces on, and the Fixbook's `fixes` package.
# Elsewhere (CI, your own Jupyter) this cell does nothing: the kernel already has both.
import sys

if "google.colab" in sys.modules:
    import subprocess

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "deepspeed=={release}",
                    "deepspeed-fixbook @ git+{url}"], check=True)'''


def expected_cell(entry: str, url: str | None = None) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(setup_source(entry, url))
    cell.metadata["tags"] = [TAG]
    return cell


def _setup_index(notebook: nbformat.NotebookNode) -> int | None:
    for index, cell in enumerate(notebook.cells):
        if TAG in cell.get("metadata", {}).get("tags", []):
            return index
    return None


def out_of_date(path: Path, url: str | None = None) -> bool:
    notebook = nbformat.read(path, as_version=4)
    index = _setup_index(notebook)
    return index is None or notebook.cells[index].source != setup_source(path.stem, url)


def sync(path: Path, url: str | None = None) -> bool:
    """Write the set-up cell (after the title cell) into one notebook; True if it changed."""
    if not out_of_date(path, url):
        return False
    notebook = nbformat.read(path, as_version=4)
    index = _setup_index(notebook)
    cell = expected_cell(path.stem, url)
    if index is None:
        first_code = next(i for i, c in enumerate(notebook.cells) if c.cell_type == "code")
        notebook.cells.insert(first_code, cell)
    else:
        notebook.cells[index].source = cell.source
    nbformat.write(notebook, path)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.colab", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["sync", "check"])
    args = parser.parse_args(argv)
    stale = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if out_of_date(p)]
    if args.command == "check":
        for path in stale:
            print(f"{path}: Colab set-up cell out of date; run `python -m ci.colab sync`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        sync(path)
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
