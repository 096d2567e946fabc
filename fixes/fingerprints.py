"""Fingerprints of DeepSpeed code, and the record of the ones each fix was written for.

A fingerprint is a short hash of a function's *source tokens*, normalised so that the same
DeepSpeed source gives the same value on every CPython from 3.9 to 3.13, and any edit to the code
(a new keyword argument, a changed line) gives a different one:

* comments, blank lines and the encoding marker are dropped;
* a token is hashed by its *kind name* and its text, never by ``tokenize``'s type number (``OP``
  is 54 on 3.9–3.11 and 55 on 3.12+);
* an f-string is one ``STRING`` token, as 3.9–3.11 read it; 3.12+ split it into
  ``FSTRING_START … FSTRING_END``, which are joined back into the literal's source text;
* ``NEWLINE``/``INDENT``/``DEDENT``/``ENDMARKER`` count by kind only (their text differs between
  tokenizer versions; the block structure they mark does not).

The record (``fixes/data/fingerprints.json``) maps entry → target → fingerprint → the releases
that ship that code. It is written by ``python -m ci.sweep.fingerprints ENTRY --write`` from the installed
releases; nobody types a fingerprint. This module uses the standard library only, so any
interpreter can load it by path (the cross-version test does).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import textwrap
import tokenize
from functools import lru_cache
from pathlib import Path
from typing import Any, Dict, Mapping, Tuple

RECORD = Path(__file__).resolve().parent / "data" / "fingerprints.json"

_DROPPED = {"COMMENT", "NL", "ENCODING"}
_STRUCTURE = {"NEWLINE", "INDENT", "DEDENT", "ENDMARKER"}

Known = Dict[str, Tuple[str, ...]]  # fingerprint -> releases that ship it


def _offsets(source: str) -> list:
    """Start offset of every line (1-based line numbers index it directly)."""
    offsets, total = [0, 0], 0
    for line in source.splitlines(keepends=True):
        total += len(line)
        offsets.append(total)
    return offsets


def tokens(source: str) -> list:
    """The normalised ``(kind, text)`` tokens of ``source`` (dedented first)."""
    source = textwrap.dedent(source)
    offsets = _offsets(source)
    kept: list = []
    depth, start = 0, None  # 3.12+: f-string nesting and where the outermost one began
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tokenize.tok_name[tok.type]
        if kind == "FSTRING_START":
            if depth == 0:
                start = tok.start
            depth += 1
            continue
        if depth:
            if kind == "FSTRING_END":
                depth -= 1
                if depth == 0:
                    (row0, col0), (row1, col1) = start, tok.end
                    kept.append(("STRING", source[offsets[row0] + col0:offsets[row1] + col1]))
            continue
        if kind in _DROPPED:
            continue
        kept.append((kind, "") if kind in _STRUCTURE else (kind, tok.string))
    return kept


def fingerprint_source(source: str) -> str:
    """The fingerprint of a piece of source code (see the module docstring)."""
    joined = "\x00".join(f"{kind}:{text}" for kind, text in tokens(source))
    return hashlib.sha256(joined.encode()).hexdigest()[:16]


def fingerprint(obj: Any) -> str:
    """The fingerprint of a function, method, staticmethod or class, from its source.

    Decorators (``functools.wraps``) are unwrapped to the code they decorate; the decorator lines
    themselves are part of the source and so of the fingerprint.
    """
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return fingerprint_source(inspect.getsource(inspect.unwrap(obj)))


@lru_cache(maxsize=None)
def _load(path: str) -> dict:
    file = Path(path)
    return json.loads(file.read_text()) if file.exists() else {}


def recorded(entry_id: str, path: Path = RECORD) -> Dict[str, Known]:
    """{target: {fingerprint: releases}} recorded for ``entry_id`` (empty if none)."""
    return {target: {fp: tuple(releases) for fp, releases in known.items()}
            for target, known in _load(str(path)).get(entry_id, {}).items()}


def dumps(record: Mapping[str, Mapping[str, Mapping[str, Any]]]) -> str:
    """The record as JSON, one line per target, sorted, so a re-recording's diff reads target by target."""
    entries = []
    for entry in sorted(record):
        lines = ",\n".join(f"  {json.dumps(target)}: {json.dumps(dict(sorted(record[entry][target].items())))}"
                           for target in sorted(record[entry]))
        entries.append(f" {json.dumps(entry)}: {{\n{lines}\n }}")
    return "{\n" + ",\n".join(entries) + "\n}\n"


def write_entry(entry_id: str, targets: Mapping[str, Mapping[str, Any]], path: Path = RECORD) -> None:
    """Replace ``entry_id``'s section of the record with ``targets`` ({target: {fp: releases}}); other entries'
    sections are kept, also where another process writes its own at the same time (:func:`~fixes.files.locked`)."""
    from .files import locked, write_atomic

    with locked(path):
        record = json.loads(path.read_text()) if path.exists() else {}
        record[entry_id] = {target: {fp: list(releases) for fp, releases in known.items()}
                            for target, known in targets.items()}
        write_atomic(path, dumps(record))  # atomic: never half a record
    _load.cache_clear()
