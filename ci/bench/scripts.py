"""What the benchmarks share (``ci.bench``, ``ci.bench.breakdown``): a notebook's code cells as one plain script and
the command that runs it as a kernel runs cells, a one-cell notebook, and the machine a figure was measured on."""
from __future__ import annotations

import datetime as dt
import os
import platform
from pathlib import Path
from typing import Any


def notebook_script(notebook: Path, parameters: dict[str, Any]) -> str:
    """The notebook's code cells as one script, with papermill's parameter values after the
    parameters cell (IPython-only lines dropped)."""
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    parts = []
    for cell in cells:
        if cell.cell_type != "code":
            continue
        parts.append("\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))))
        if "parameters" in cell.get("metadata", {}).get("tags", []):
            parts.append("\n".join(f"{name} = {value!r}" for name, value in parameters.items()))
    return "\n\n".join(parts) + "\n"


def script_command(script: Path) -> list[str]:
    """Python arguments that run ``script`` as a kernel runs cells: its code executed in a namespace, with a
    ``__main__`` that has no file. Run as ``python script.py``, each rank that ``harness.launch`` spawns would
    re-run the script's top level (multiprocessing's spawn re-imports a main *file*) and set DeepSpeed up a
    second time on the parent's MASTER_PORT (EADDRINUSE)."""
    return ["-c", f"path = {str(script)!r}; exec(compile(open(path).read(), path, 'exec'), "
                  "{'__name__': '__main__', '__builtins__': __builtins__})"]


def tiny_notebook(path: Path, kernel: str) -> Path:
    """A notebook of one cell, ``pass``, on ``kernel``, written to ``path``: what papermill costs around the cells."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": kernel, "language": "python", "display_name": kernel}
    nb.cells = [nbformat.v4.new_code_cell("pass")]
    nbformat.write(nb, path)
    return path


def machine() -> dict[str, Any]:
    """The date, CPUs, processor, Python and load average now: recorded with each section's figures."""
    return {"date": dt.date.today().isoformat(), "cpus": os.cpu_count(), "processor": platform.processor() or
            platform.machine(), "python": platform.python_version(),
            "load_average": round(os.getloadavg()[0], 1)}  # other work on the machine while it ran
