"""Which entry explains a pasted error: the whole paste, weighed, with the release in mind.

A paste is read for what it holds (:func:`parse`): the ``Type: message`` lines, the DeepSpeed frames
of a traceback (``deepspeed/runtime/zero/stage_1_and_2.py … in reduce_ipg_grads``), with torchrun's
``[rankN]:`` prefixes dropped and wrapped lines rejoined. Each entry's evidence comes from what it
states once: its error signatures (:class:`~fixes.fix.FixInfo`) and the DeepSpeed code it names
(its targets and the files and functions of its root cause).

A signature is *generic* when it is a message any library raises (``KeyError: 0``, ``list index
out of range``, a segmentation fault): alone it is weak evidence, and none at all when the paste's
traceback has frames but none in DeepSpeed. The verdict is one of three words:

* **strong** — a specific signature, or a generic one raised from the code the entry names;
* **possible** — a generic signature with no traceback to tell, DeepSpeed frames of the entry's
  code without its message, or most words of a described symptom;
* **no match** — anything else (the entry is not listed).

With a release (the installed one, or one named), an entry measured *not affected* there drops one
level, and the result says so. Stdlib only: ``fixbook search`` and the site share it.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from .versions import parse as parse_version

if TYPE_CHECKING:
    from .fix import Fix

Level = Literal["strong", "possible", "no match"]
LEVELS: tuple[Level, ...] = ("strong", "possible", "no match")

_RANK_PREFIX = re.compile(r"^\s*\[?rank\s*\d+\]?:\s?", re.IGNORECASE | re.MULTILINE)
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line \d+,? in (?P<function>[\w<>.]+)')
_EXCEPTION = re.compile(r"^\s*(?P<type>(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)|Fatal Python error)"
                        r":\s?(?P<message>.*)$", re.MULTILINE)
_TYPE_PREFIX = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\s*:\s*|^fatal python error\s*:\s*", re.IGNORECASE)
# Messages any library raises: alone they say nothing about which bug.
GENERIC_MESSAGES = ("list index out of range", "segmentation fault", "out of memory", "core dumped",
                    "index out of range", "unknown parameter type")
# Function names too common to say which code raised: a frame "in backward" is no evidence by itself.
COMMON_FUNCTIONS = frozenset({"backward", "forward", "step", "apply", "wrapper", "__init__", "__call__", "_call_impl",
                              "run_backward", "train", "main", "wrapped_fn", "decorate_context"})
_STOPWORDS = frozenset("the a an of in on to with and or is are for by not no does do when from than as at it its "
                       "instead after before".split())


@dataclass(frozen=True)
class Paste:
    """What a pasted error holds."""

    text: str  # rank prefixes removed
    exceptions: tuple[tuple[str, str], ...]  # (type, message) of each exception line
    frames: tuple[tuple[str, str], ...]  # (path from "deepspeed/", function) of each DeepSpeed frame
    has_traceback: bool  # any "File ..., line N" frame at all (DeepSpeed's or not)

    @property
    def flat(self) -> str:
        """Lower case, whitespace collapsed: a signature cut over lines still matches."""
        return " ".join(self.text.lower().split())

    @property
    def dense(self) -> str:
        """Lower case, no whitespace at all: a signature hard-wrapped mid-word still matches."""
        return re.sub(r"\s+", "", self.text.lower())


def _unwrap_frames(text: str) -> str:
    """Rejoin ``File "…", line N, in f`` lines that a terminal or a chat window wrapped."""
    out: list[str] = []
    for line in text.splitlines():
        previous = out[-1] if out else ""
        if re.match(r'\s*File "', previous) and not _FRAME.search(previous):
            out[-1] = previous + ("" if previous.count('"') % 2 else " ") + line.strip()
        else:
            out.append(line)
    return "\n".join(out)


def parse(text: str) -> Paste:
    clean = _unwrap_frames(_RANK_PREFIX.sub("", text))
    frames = []
    any_frame = False
    for match in _FRAME.finditer(clean):
        any_frame = True
        path = match.group("path").replace("\\", "/")
        if "deepspeed/" in path:
            frames.append(("deepspeed/" + path.rsplit("deepspeed/", 1)[1], match.group("function")))
    exceptions = tuple((m.group("type"), m.group("message").strip()) for m in _EXCEPTION.finditer(clean))
    return Paste(clean, exceptions, tuple(frames), any_frame)


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z0-9_]+", text.lower()) if len(w) > 2 and w not in _STOPWORDS}


def is_generic(signature: str) -> bool:
    """Whether a signature is a message many libraries raise (weak evidence on its own)."""
    message = _TYPE_PREFIX.sub("", signature).strip().lower()
    if message in GENERIC_MESSAGES:
        return True
    has_type = message != signature.strip().lower()
    return has_type and len(message) <= 20 and " " not in message  # "KeyError: 0", "ValueError: x"


@dataclass(frozen=True)
class Evidence:
    """What an entry is known by: its signatures, and the DeepSpeed code it names."""

    fix_id: str
    specific: tuple[str, ...]
    generic: tuple[str, ...]
    descriptive: tuple[str, ...]  # symptom descriptions (no exception type, several words)
    files: frozenset[str]  # "deepspeed/runtime/zero/stage_1_and_2.py"
    functions: frozenset[str]  # "reduce_ipg_grads": named in the root cause (any file)
    code: frozenset[tuple[str, str]]  # (file, function) of each target
    names: frozenset[str] = frozenset()  # the targets' class names: a traceback's source lines show them


def evidence(fix: "Fix") -> Evidence:
    info = fix.info
    specific, generic, descriptive = [], [], []
    for signature in info.error_signatures:
        if is_generic(signature):
            generic.append(signature)
        elif _TYPE_PREFIX.match(signature) or not re.search(r"\s", signature.strip()) or len(_words(signature)) <= 2:
            specific.append(signature)
        else:
            specific.append(signature)
            descriptive.append(signature)
    files = set(re.findall(r"deepspeed/[\w/]+\.py", info.root_cause))
    code, names = set(), set()
    for target in getattr(fix, "targets", ()):
        path = target.module.replace(".", "/") + ".py"
        files.add(path)
        code.add((path, target.qualname.rsplit(".", 1)[-1]))
        if "." in target.qualname and len(target.qualname.split(".")[0]) >= 12:
            names.add(target.qualname.split(".")[0])
    # Class.method / module.function named in the root cause; names every library uses are no evidence
    functions = {name for name in re.findall(r"\b[A-Za-z]\w*\.(_?[a-z]\w+)\b", info.root_cause)
                 if len(name) > 3 and name not in COMMON_FUNCTIONS and not name.endswith("py")}
    return Evidence(info.id, tuple(specific), tuple(generic), tuple(descriptive), frozenset(files),
                    frozenset(functions), frozenset(code), frozenset(names))


def _contains(paste: Paste, signature: str) -> bool:
    flat_sig = " ".join(signature.lower().split())
    if re.search(r"(?<![\w])" + re.escape(flat_sig) + r"(?![\w])", paste.flat):
        return True
    dense_sig = re.sub(r"\s+", "", signature.lower())
    return len(dense_sig) >= 24 and dense_sig in paste.dense  # hard-wrapped mid-word


@dataclass
class Match:
    """One entry's answer to a paste."""

    fix_id: str
    level: Level
    score: float
    why: list[str] = field(default_factory=list)
    release_note: str = ""

    @property
    def rank_key(self) -> tuple[int, float, str]:
        return (LEVELS.index(self.level), -self.score, self.fix_id)


def _downgrade(level: Level) -> Level:
    return LEVELS[min(LEVELS.index(level) + 1, len(LEVELS) - 1)]


def match(paste: Paste, known: Evidence) -> Match:
    """How well ``paste`` fits one entry, and why."""
    why: list[str] = []
    score = 0.0
    specific = [s for s in known.specific if _contains(paste, s)]
    # A generic signature matches whole ("KeyError: 0"); one whose message is a phrase any library
    # prints ("Segmentation fault") also matches that phrase alone ("Segmentation fault (core dumped)").
    generic = [s for s in known.generic if _contains(paste, s) or (
        _TYPE_PREFIX.sub("", s).strip().lower() in GENERIC_MESSAGES and _contains(paste, _TYPE_PREFIX.sub("", s)))]
    frame_functions = sorted({f for path, f in paste.frames
                              if (path, f) in known.code or (f in known.functions and f not in COMMON_FUNCTIONS)})
    frame_files = sorted({path for path, _ in paste.frames if path in known.files})
    innermost = paste.frames[-1] if paste.frames else None
    described = max((len(_words(d) & _words(paste.text)) / len(_words(d)) for d in known.descriptive if _words(d)),
                    default=0.0)
    if specific:
        score += 3 + 0.01 * max(len(s) for s in specific)
        why.append(f"its error text: {specific[0]!r}")
    if generic:
        score += 1
        why.append(f"a common message it explains: {generic[0]!r}")
    if frame_functions:
        score += 1 + min(len(frame_functions), 3) * 0.5
        if innermost and innermost[1] in frame_functions:
            score += 1  # raised right there
        why.append(f"raised in the code it names: {', '.join(frame_functions)}")
    elif frame_files:
        score += 1
        why.append(f"DeepSpeed frames in {', '.join(frame_files)}")
    named = sorted(name for name in known.names if re.search(rf"\b{re.escape(name)}\b", paste.text))
    if named and (specific or generic or frame_files):
        score += 0.5
        why.append(f"its code is named: {', '.join(named)}")
    if specific or (generic and (frame_functions or frame_files)):
        level: Level = "strong"
    elif generic and paste.has_traceback and not paste.frames:
        level = "no match"  # the traceback says where it came from, and that is not DeepSpeed
        why.append("but the traceback has no DeepSpeed frame")
    elif generic or frame_functions or (described >= 0.75 and len(known.descriptive) > 0):
        level = "possible"
        if described >= 0.75 and not (generic or frame_functions):
            score += described
            why.append(f"{described:.0%} of a described symptom's words")
    else:
        level = "no match"
    return Match(known.fix_id, level, score, why)


def search(text: str, fixes: list["Fix"], release: str | None = None) -> list[Match]:
    """Every entry that strongly or possibly explains ``text``, best first. With ``release``, an
    entry measured not affected there drops one level (``release_note`` says so)."""
    paste = parse(text)
    found = []
    for fix in fixes:
        result = match(paste, evidence(fix))
        if result.level == "no match":
            continue
        if release is not None:
            affected = fix.info.expected_affected(release)
            if affected is False:
                result.level = _downgrade(result.level)
                result.release_note = f"measured not affected on DeepSpeed {release}"
            elif affected is None:
                result.release_note = f"not measured on DeepSpeed {release}"
            else:
                result.score += 0.5
                result.release_note = f"measured affected on DeepSpeed {release}"
        if result.level != "no match":
            found.append(result)
    return sorted(found, key=lambda m: m.rank_key)


def site_data(fixes: list["Fix"]) -> dict:
    """Everything the site's error matcher (``docs/javascripts/error-match.js``) needs to give the
    answers :func:`search` gives (no release): each entry's evidence and the constants above."""
    entries = []
    for fix in fixes:
        known = evidence(fix)
        entries.append({
            "id": known.fix_id, "title": fix.info.title,
            "specific": list(known.specific),
            "generic": [{"signature": g, "phrase": (_TYPE_PREFIX.sub("", g).strip()
                                                    if _TYPE_PREFIX.sub("", g).strip().lower() in GENERIC_MESSAGES else None)}
                        for g in known.generic],
            "descriptive": [sorted(_words(d)) for d in known.descriptive],
            "files": sorted(known.files), "functions": sorted(known.functions),
            "code": sorted([list(pair) for pair in known.code]), "names": sorted(known.names),
        })
    return {"entries": entries, "stopwords": sorted(_STOPWORDS), "common_functions": sorted(COMMON_FUNCTIONS)}


# ---- the second tier: fixes upstream made that the Fixbook has not reproduced ------------------------

UPSTREAM_FIXES = Path(__file__).resolve().parent / "data" / "upstream_fixes.json"


@dataclass(frozen=True)
class UpstreamMatch:
    """A known upstream fix whose description names what the paste shows. Not reproduced here: no
    proof and no fix module, only where upstream says it was fixed."""

    pr: int | None
    subject: str
    component: str
    symptom: str
    first_release: str | None
    named: tuple[str, ...]  # the identifiers of its description found in the paste
    release_note: str = ""
    upstream_test: str = ""  # what upstream's own fix-PR test showed on CPU here (upstream_test_line)

    @property
    def url(self) -> str:
        return f"https://github.com/deepspeedai/DeepSpeed/pull/{self.pr}" if self.pr else ""


def _identifiers(text: str) -> set[str]:
    """Names in a description that code prints: CamelCase, snake_case, dotted, or an exception type."""
    found = set()
    for token in re.findall(r"[A-Za-z_][\w.]*[A-Za-z0-9_]", text):
        if len(token) >= 6 and ("_" in token.strip("_") or re.search(r"[a-z][A-Z]", token) or token.endswith(("Error", "Exception"))):
            found.add(token)
    return found


@cache
def upstream_rows() -> tuple[dict, ...]:
    """User-visible rows of the census (``fixes/data/upstream_fixes.json``) no entry measures."""
    if not UPSTREAM_FIXES.exists():
        return ()
    rows = json.loads(UPSTREAM_FIXES.read_text())["rows"]
    return tuple(r for r in rows if r["user_visible"] and r.get("triage", {}).get("status") != "entry"
                 and r["check"]["status"] != "measured")


def upstream_test_line(row: dict) -> str:
    """What upstream's own fix-PR test showed for ``row`` on CPU (``python -m ci.triage``), in a line; "" where it
    was not run."""
    tested = row.get("upstream_test")
    if not tested:
        return ""
    state, before, after = tested["state"], tested.get("before"), tested.get("after")
    if state == "reproduced by upstream's test":
        return f"reproduced by upstream's test on CPU ({before} fails, {after} passes) — no entry yet"
    if state == "not detected on CPU":
        return f"upstream's test does not detect it on CPU ({before} passes)"
    if state == "needs an accelerator":
        return "upstream's test needs an accelerator (it skips or fails for want of CUDA on CPU)"
    if state == "no upstream test":
        return "the fix PR ships no test"
    return f"upstream's test could not run here: {tested.get('reason', '')[:120]}"


def upstream(text: str, release: str | None = None) -> list[UpstreamMatch]:
    """Known upstream fixes whose description names two things the paste shows, one of them code
    (a function, a class, a config key): the second tier, always listed after the entries."""
    paste = parse(text)
    shown = paste.text
    found = []
    for row in upstream_rows():
        names = _identifiers(f"{row['subject']} {row['note']}")
        named = tuple(sorted(n for n in names if re.search(rf"(?<![\w.]){re.escape(n)}(?![\w])", shown)))
        code = [n for n in named if not n.endswith(("Error", "Exception"))]
        if len(named) >= 2 and code:
            note = ""
            if release and row["first_release"]:
                lacks = parse_version(release) < parse_version(row["first_release"])
                note = (f"DeepSpeed {release} predates this fix" if lacks else
                        f"DeepSpeed {release} already has this fix")
            found.append(UpstreamMatch(row["pr"], row["subject"], row["component"], row["symptom"],
                                       row["first_release"], named, note, upstream_test_line(row)))
    return sorted(found, key=lambda m: (-len(m.named), m.pr or 0))


def upstream_reproduced_lacking(release: str) -> dict[str, int]:
    """{component: count} of the known upstream fixes first released after ``release`` whose own fix-PR test fails
    on CPU without the fix and passes with it: bugs shown here, with no entry yet."""
    counts: dict[str, int] = {}
    for row in upstream_rows():
        tested = row.get("upstream_test") or {}
        if (tested.get("state") == "reproduced by upstream's test" and row["first_release"]
                and parse_version(release) < parse_version(row["first_release"])):
            counts[row["component"]] = counts.get(row["component"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def upstream_lacking(release: str) -> dict[str, int]:
    """{component: count} of the known upstream fixes (second tier) first released after ``release``."""
    counts: dict[str, int] = {}
    for row in upstream_rows():
        if row["first_release"] and parse_version(release) < parse_version(row["first_release"]):
            counts[row["component"]] = counts.get(row["component"], 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
