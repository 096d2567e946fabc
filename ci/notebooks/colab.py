"""The Colab entry point of every notebook: a first cell that, on Colab only, installs the
DeepSpeed release the entry reproduces on and the ``fixes`` package from the repository.

The repository URL has one home, ``repo_url`` in ``mkdocs.yml``; notebooks are stored with the
cell written out (Colab opens them straight from the repository), so ``sync`` rewrites it from
that setting and the registry, and the tests fail while any notebook is out of date.

    python -m ci.notebooks.colab sync   # rewrite the cell in every notebook
    python -m ci.notebooks.colab check  # exit 1 if any notebook is out of date

:func:`fresh_runtime` builds a kernel shaped like a new Colab runtime (no DeepSpeed, no ``fixes``,
``google.colab`` imported at start-up), in which the cell does its install: the tests run a notebook
there with the cell pointed at the local checkout (:func:`local_url`) instead of GitHub.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat

import fixes

from .. import ROOT
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


RUNTIME_KERNEL = "fixbook-colab-runtime"
_COLAB_IMPORTED = 'import sys, types; sys.modules.setdefault("google.colab", types.ModuleType("google.colab"))'


def local_url(checkout: Path = ROOT) -> str:
    """The checkout as a ``git+`` URL pip accepts in ``name @ URL`` (pip installs its committed HEAD)."""
    return f"file://localhost{checkout.resolve()}"


def fresh_runtime(path: Path, base: str = "colab-shape") -> Path:
    """Build at ``path`` a kernel shaped like a fresh Colab runtime and return its kernel directory
    (put ``path / "share" / "jupyter"`` on ``JUPYTER_PATH`` to use kernel :data:`RUNTIME_KERNEL`).

    The runtime is a venv of the ``base`` environment's Python that sees that environment's packages
    (torch as PyPI ships it, ipykernel, setuptools' ``distutils``, what DeepSpeed requires) through
    ``site.addsitedir``, but holds no DeepSpeed and no ``fixes``: a notebook's set-up cell must install
    them into it, as on Colab. ``google.colab`` is imported at start-up, as Colab's kernel does, so the
    cell sees Colab. The kernel runs on the CPU accelerator (no GPU here). Raises
    :class:`ci.releases.environments.EnvironmentError_` if ``base`` is not built."""
    from ..releases import environments

    env = environments.require(base)
    subprocess.run([str(env.executable), "-m", "venv", "--without-pip", str(path)], check=True)
    subprocess.run([str(path / "bin" / "python"), "-m", "ensurepip", "--default-pip"], check=True,
                   capture_output=True)
    purelib = subprocess.run([str(path / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    base_lib = subprocess.run([str(env.executable), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "fixbook_colab_runtime.pth").write_text(
        f"import site; site.addsitedir({base_lib!r})\n{_COLAB_IMPORTED}\n")
    kernel_dir = path / "share" / "jupyter" / "kernels" / RUNTIME_KERNEL
    kernel_dir.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [str(path / "bin" / "python"), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": f"A fresh Colab runtime's shape ({base}), Fixbook", "language": "python",
            "env": {"DS_ACCELERATOR": "cpu", "FIXBOOK_ENVIRONMENT": base}, "metadata": {"debugger": False}}
    (kernel_dir / "kernel.json").write_text(json.dumps(spec, indent=1))
    return kernel_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.notebooks.colab", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["sync", "check"])
    args = parser.parse_args(argv)
    stale = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if out_of_date(p)]
    if args.command == "check":
        for path in stale:
            print(f"{path}: Colab set-up cell out of date; run `python -m ci.notebooks.colab sync`", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        sync(path)
        print(f"updated {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
