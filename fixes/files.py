"""Writing the Fixbook's records so that a reader, an interrupt or a crash never sees half a file."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

INFO_FILE = "info.toml"  # an entry's metadata, beside its __init__.py: the fields of fixes.fix.FixInfo, once


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


@contextlib.contextmanager
def locked(path: Path | str) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s lock file (``.<name>.lock`` beside it) for a read-modify-write of
    ``path``, so that two writers (two tools recording side by side) never lose each other's rows. Blocks until
    the lock is free. Where ``fcntl`` does not exist (Windows) it does not lock."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path.with_name(f".{path.name}.lock"), "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
