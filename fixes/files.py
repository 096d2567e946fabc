"""Writing the Fixbook's records so that a reader, an interrupt or a crash never sees half a file."""
from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path | str, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and move it into place (``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
