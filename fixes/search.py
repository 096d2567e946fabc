"""Which entry explains a pasted error: the whole paste, weighed, with the release in mind.

A paste is read for what it holds (:func:`parse`): the ``Type: message`` lines, the DeepSpeed frames
of a traceback (``deepspeed/runtime/zero/stage_1_and_2.py … in reduce_ipg_grads``), with torchrun's
``[rankN]:`` prefixes dropped and wrapped lines rejoined. Each entry's evidence comes from what it
states once: its error signatures (:class:`~fixes.fix.FixInfo`) and the DeepSpeed code it names
(its targets and the files and functions of its root cause).

A signature is *generic* when it is a message any library raises (``KeyError: 0``, ``list index
out of range``, a segmentation fault): alone it is weak evidence, and none at all when the paste's
traceback has frames but none in DeepSpeed. The verdict is one of three words:

* **strong** — a specific signature, five or more consecutive words of one of its error lines (a line
  with an exception type: the distinctive fragment a person types into a search box; none of them words of
  a Python message template such as ``invalid literal for int() with base 10``), or a generic signature
  raised from the code the entry names;
* **possible** — a strong match whose text names a scheduler, an optimizer class or a ZeRO stage of the entry's
  kind and none the entry is about (:func:`contradiction`: a WarmupDecayLR report against a WarmupCosineLR bug with
  the same ZeroDivisionError); a generic signature with no traceback to tell, DeepSpeed frames of the entry's
  code without its message, a rare identifier of its error text (``no_sync``, ``setup_context``),
  most words of a described symptom, or a prose description its statement ranks for
  (:mod:`fixes.prose`, BM25; the matched words are shown);
* **no match** — anything else (the entry is not listed).

With a release (the installed one, or one named), an entry measured *not affected* there drops one
level, and the result says so. ``fixbook search`` and the site (``docs/javascripts/error-match.js``) give the same
answers; the prose ranking needs ``rank_bm25``.
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
    from .prose import Index

Level = Literal["strong", "possible", "no match"]
LEVELS: tuple[Level, ...] = ("strong", "possible", "no match")

_RANK_PREFIX = re.compile(r"^\s*\[?rank\s*\d+\]?:\s?", re.IGNORECASE | re.MULTILINE)
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line \d+,? in (?P<function>[\w<>.]+)')
_EXCEPTION = re.compile(r"^\s*(?P<type>(?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)|Fatal Python error)"
                        r":\s?(?P<message>.*)$", re.MULTILINE)
_TYPE_PREFIX = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception)\s*:\s*|^fatal python error\s*:\s*", re.IGNORECASE)
# Messages any library raises: alone they say nothing about which bug.
GENERIC_MESSAGES = ("list index out of range", "segmentation fault", "out of memory", "core dumped",
                    "index out of range", "unknown parameter type",
                    # DeepSpeed's LR schedulers log it whenever the LR is read before the first step, bug or not
                    "attempting to get learning rate from scheduler before it has started")
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
    error_lines: tuple[tuple[str, ...], ...] = ()  # the words of each error line (a signature with an exception type)
    identifiers: frozenset[str] = frozenset()  # identifiers its error text names (no_sync, setup_context)
    about: tuple[tuple[str, frozenset[str]], ...] = ()  # (family, members) the entry is about (:func:`entry_about`)


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
    error_lines = tuple(error_line_words(_TYPE_PREFIX.sub("", s)) for s in specific if _TYPE_PREFIX.match(s))
    identifiers = {token for s in info.error_signatures for token in _IDENTIFIER.findall(s) if _is_identifier(token)}
    return Evidence(info.id, tuple(specific), tuple(generic), tuple(descriptive), frozenset(files),
                    frozenset(functions), frozenset(code), frozenset(names), error_lines, frozenset(identifiers),
                    entry_about(fix))


# ---- what a report names that an entry may contradict --------------------------------------------------------------

# DeepSpeed's LR scheduler classes (deepspeed/runtime/lr_schedules.py), each with the classes it inherits from: a
# report of a subclass may show a bug of its base class's code.
SCHEDULERS: dict[str, tuple[str, ...]] = {"WarmupLR": (), "WarmupDecayLR": ("WarmupLR",), "WarmupCosineLR": (),
                                          "OneCycle": (), "LRRangeTest": ()}
# DeepSpeed's own optimizer classes (deepspeed/ops): a report names the one its traceback or config runs.
OPTIMIZERS: tuple[str, ...] = ("FusedAdam", "DeepSpeedCPUAdam", "FusedLamb", "OnebitAdam", "ZeroOneAdam", "OnebitLamb",
                               "DeepSpeedCPUAdagrad", "FusedLion", "DeepSpeedCPULion")
STAGES: tuple[str, ...] = ("0", "1", "2", "3")
# How a report names a ZeRO stage: "ZeRO-3", "zero3", "ZeRO stage 2", "zero_stage: 1", "zero_optimization.stage=3", a
# config's "stage": 3 (the same patterns in Python and in the site's matcher).
STAGE_PATTERNS: tuple[str, ...] = (r"\bzero[-_ ]?(?:optimization[._ ]?)?(?:stage\W{0,4})?([0-3])\b",
                                   r'"stage"\s*:\s*"?([0-3])\b')
# The DeepSpeed files only one ZeRO stage's code runs: a traceback through them names the stage.
STAGE_FILES: dict[str, tuple[str, ...]] = {"deepspeed/runtime/zero/stage3.py": ("3",),
                                           "deepspeed/runtime/zero/partition_parameters.py": ("3",),
                                           "deepspeed/runtime/zero/parameter_offload.py": ("3",),
                                           "deepspeed/runtime/zero/stage_1_and_2.py": ("1", "2")}
FAMILIES = ("scheduler", "optimizer", "ZeRO stage")


def entry_about(fix: "Fix") -> tuple[tuple[str, frozenset[str]], ...]:
    """Which scheduler, optimizer class or ZeRO stage the entry's bug is in, where it is in one: from its measured
    trigger (the conditions on ``scheduler`` and ``zero_stage``, asked of each value) and the classes its fix
    patches. A family the entry says nothing of is left out: no report can contradict it there."""
    if id(fix) in _ABOUT:
        return _ABOUT[id(fix)][1]
    from .trigger import Job

    trigger = getattr(fix, "trigger", None)
    conditions = trigger.conditions if trigger is not None else ()
    classes = {target.qualname.split(".")[0] for target in getattr(fix, "targets", ())}
    about = {"scheduler": {name for name in SCHEDULERS if name in classes},
             "optimizer": {name for name in OPTIMIZERS if name in classes}, "ZeRO stage": set()}
    for condition in conditions:
        if condition.key == "scheduler":
            about["scheduler"] |= {name for name in SCHEDULERS if condition(Job(scheduler=name))}
        elif condition.key == "zero_stage":
            about["ZeRO stage"] |= {stage for stage in STAGES if condition(Job(zero_stage=int(stage)))}
    found = tuple((family, frozenset(about[family])) for family in FAMILIES if about[family])
    _ABOUT[id(fix)] = (fix, found)  # the fix is kept so that its id is not reused while cached
    return found


_ABOUT: dict[int, tuple["Fix", tuple[tuple[str, frozenset[str]], ...]]] = {}


def report_names(paste: Paste) -> dict[str, set[str]]:
    """The schedulers, optimizer classes and ZeRO stages a report names (its text, its config, its traceback)."""
    named: dict[str, set[str]] = {family: set() for family in FAMILIES}
    for name, bases in SCHEDULERS.items():
        if re.search(rf"\b{name}\b", paste.text):
            named["scheduler"] |= {name, *bases}
    named["optimizer"] = {name for name in OPTIMIZERS if re.search(rf"\b{name}\b", paste.text)}
    for pattern in STAGE_PATTERNS:
        named["ZeRO stage"] |= set(re.findall(pattern, paste.text, re.IGNORECASE))
    for path, _ in paste.frames:
        named["ZeRO stage"] |= set(STAGE_FILES.get(path, ()))
    return named


def contradiction(paste: Paste, known: Evidence) -> str:
    """Why the report cannot be of the entry's bug, "" where it can: it names a scheduler, optimizer class or ZeRO
    stage of the entry's family and none that the entry is about."""
    named = report_names(paste)
    for family, members in known.about:
        if named[family] and not named[family] & members:
            shown = sorted(named[family] - {base for name in named[family] for base in SCHEDULERS.get(name, ())})
            return (f"but the text names {family} {', '.join(shown)}, and this entry is about {family} "
                    f"{' or '.join(sorted(members))}")
    return ""


FRAGMENT_WORDS = 5  # consecutive words of an error line that identify it
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _plain_words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9_]+", text.lower())


def _is_identifier(token: str) -> bool:
    """A name code prints: snake_case or camelCase, six characters or more (``no_sync``, ``setup_context``)."""
    return (len(token) >= 6 and ("_" in token.strip("_") or bool(re.search(r"[a-z][A-Z]", token)))
            and not token.endswith(("Error", "Exception", "Warning")))


# The words of message templates ("'X' object has no attribute 'y'", "expected ... but got ..."): a fragment made of
# them and one name says only which template, not which error.
TEMPLATE_WORDS = frozenset("object has have no not attribute is are a an the of to in be for with and or but got "
                           "expected must can cannot does do this that it".split())
FRAGMENT_CONTENT = 3  # words of a fragment that are not template words


# CPython's own message templates: their words say which Python error it is ("invalid literal for int() with base
# 10: 'abc'"), never which bug. An error line's words that come from one are marked (:func:`error_line_words`), so
# that no fragment is made of them; a paste of the whole signature still matches it whole.
BUILTIN_TEMPLATES = tuple(re.compile(pattern) for pattern in (
    r"invalid literal for int\(\) with base \d+", r"could not convert string to float", r"unsupported operand type\(s\) for",
    r"object is not (?:subscriptable|callable|iterable)", r"(?:not enough|too many) values to unpack(?: \(expected \d+)?",
    r"takes \d+ positional arguments? but \d+ (?:was|were) given", r"got an unexpected keyword argument",
    r"missing \d+ required (?:positional|keyword-only) arguments?", r"can only concatenate \w+ \(not",
    r"division by zero", r"unhashable type", r"maximum recursion depth exceeded", r"cannot unpack non-iterable",
    r"argument of type"))
_MARK = "~"  # before a template's word: no word of a paste (``[a-z0-9_]+``) equals it


def error_line_words(message: str) -> tuple[str, ...]:
    """The words of an error line, those of a :data:`BUILTIN_TEMPLATES` phrase marked (``~invalid``)."""
    text = message.lower()
    for template in BUILTIN_TEMPLATES:
        text = template.sub(lambda found: " ".join(_MARK + word for word in _plain_words(found.group())), text)
    return tuple(re.findall(rf"{_MARK}?[a-z0-9_]+", text))


def _fragment(paste_words: list[str], line: tuple[str, ...]) -> str:
    """The first run of :data:`FRAGMENT_WORDS` consecutive words of ``line`` that the paste has and that holds
    :data:`FRAGMENT_CONTENT` words or more outside :data:`TEMPLATE_WORDS`, or ""."""
    if len(line) < FRAGMENT_WORDS:
        return ""
    grams = {tuple(paste_words[i:i + FRAGMENT_WORDS]) for i in range(len(paste_words) - FRAGMENT_WORDS + 1)}
    for i in range(len(line) - FRAGMENT_WORDS + 1):
        run = line[i:i + FRAGMENT_WORDS]
        if run in grams and sum(word not in TEMPLATE_WORDS for word in run) >= FRAGMENT_CONTENT:
            return " ".join(run)
    return ""


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


def match(paste: Paste, known: Evidence, rare: frozenset[str] = frozenset()) -> Match:
    """How well ``paste`` fits one entry, and why. ``rare``: the identifiers of error text that at most two
    entries name (:func:`rare_identifiers`)."""
    why: list[str] = []
    score = 0.0
    specific = [s for s in known.specific if _contains(paste, s)]
    if not specific:
        words = _plain_words(paste.text)
        fragments = [f for f in (_fragment(words, line) for line in known.error_lines) if f]
        if fragments:
            specific = fragments
            why.append(f"part of its error text: {fragments[0]!r}")
    identifiers = sorted(name for name in known.identifiers & rare
                         if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", paste.text))
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
        if not why:
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
    contradicts = contradiction(paste, known)
    if (specific or (generic and (frame_functions or frame_files))) and not contradicts:
        level: Level = "strong"
    elif specific or (generic and (frame_functions or frame_files)):
        level = "possible"  # the error fits, but what the text names is not what the entry is about
        why.append(contradicts)
    elif generic and paste.has_traceback and not paste.frames:
        level = "no match"  # the traceback says where it came from, and that is not DeepSpeed
        why.append("but the traceback has no DeepSpeed frame")
    elif generic or frame_functions or identifiers or (described >= 0.75 and len(known.descriptive) > 0):
        level = "possible"
        if identifiers and not (generic or frame_functions):
            score += 0.5
            why.append(f"names {', '.join(identifiers)} from its error text")
        if described >= 0.75 and not (generic or frame_functions):
            score += described
            why.append(f"{described:.0%} of a described symptom's words")
    else:
        level = "no match"
    return Match(known.fix_id, level, score, why)


_SOURCE_LINE = re.compile(r"^\s*(?:\^+|~+[\^~]*)\s*$")


def prose_text(text: str) -> str:
    """What a person wrote, without what an error printed: the ``Traceback (most recent call last)`` header, each
    ``File "…", line N, in f`` frame and the source line printed under it, the ``^^^`` markers, and the exception
    lines (``Type: message``; an error's words are evidence as error text, matched by the signatures). What prose
    ranking reads (:mod:`fixes.prose`)."""
    kept: list[str] = []
    after_frame = False
    for line in re.split(r"\r?\n", text):  # as the site splits it
        if _FRAME.search(line) or line.strip().startswith("Traceback (most recent call last)"):
            after_frame = bool(_FRAME.search(line))
            continue
        if _SOURCE_LINE.match(line) or (after_frame and line.startswith((" ", "\t"))) or _EXCEPTION.match(line):
            continue
        after_frame = False
        kept.append(line)
    return "\n".join(kept)


def rare_identifiers(known: list[Evidence]) -> frozenset[str]:
    """The identifiers of error text that at most two entries name: a paste naming one points at those entries."""
    counts: dict[str, int] = {}
    for one in known:
        for name in one.identifiers:
            counts[name] = counts.get(name, 0) + 1
    return frozenset(name for name, count in counts.items() if count <= 2)


PROSE_WEIGHT = 0.1  # a BM25 score (4 - 30) as a match score: below any error-text evidence (3+)
PROSE_TIE = 0.001  # added to a strong match: never more than a tie-breaker


def prose_index(fixes: list["Fix"]) -> "Index":
    from .prose import Index, entry_document

    key = tuple((fix.id, id(fix.info)) for fix in fixes)
    if _PROSE_CACHE.get("key") != key:
        _PROSE_CACHE.update(key=key, index=Index([fix.id for fix in fixes], [entry_document(fix.info) for fix in fixes]))
    return _PROSE_CACHE["index"]


_PROSE_CACHE: dict = {}


def search(text: str, fixes: list["Fix"], release: str | None = None) -> list[Match]:
    """Every entry that strongly or possibly explains ``text``, best first. With ``release``, an
    entry measured not affected there drops one level (``release_note`` says so)."""
    paste = parse(text)
    known = [evidence(fix) for fix in fixes]
    rare = rare_identifiers(known)
    # A traceback whose frames are all elsewhere says where the error came from: not DeepSpeed, so no prose match.
    elsewhere = paste.has_traceback and not paste.frames
    prose = {} if elsewhere else {ranked.key: ranked for ranked in prose_index(fixes).rank(prose_text(paste.text))}
    found = []
    for fix, entry_evidence in zip(fixes, known):
        result = match(paste, entry_evidence, rare)
        ranked = prose.get(fix.id)
        if ranked is not None:  # error-text evidence decides between strong matches; prose only breaks a tie
            result.score += (PROSE_TIE if result.level == "strong" else PROSE_WEIGHT) * ranked.score
            if result.level == "no match":
                result.level = "possible"
            if result.level == "possible":
                result.why.append(f"its description shares: {', '.join(ranked.words)}")
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
            "error_lines": [list(line) for line in known.error_lines], "identifiers": sorted(known.identifiers),
            "about": [[family, sorted(members)] for family, members in known.about],
        })
    rare = rare_identifiers([evidence(fix) for fix in fixes])
    return {"entries": entries, "stopwords": sorted(_STOPWORDS), "common_functions": sorted(COMMON_FUNCTIONS),
            "rare": sorted(rare), "fragment_words": FRAGMENT_WORDS, "fragment_content": FRAGMENT_CONTENT,
            "template_words": sorted(TEMPLATE_WORDS), "prose_weight": PROSE_WEIGHT, "prose_tie": PROSE_TIE,
            "prose": prose_index(fixes).export(), "prose_stopwords": sorted(_prose_stopwords()),
            "schedulers": SCHEDULERS, "optimizers": list(OPTIMIZERS), "stage_patterns": list(STAGE_PATTERNS),
            "stage_files": STAGE_FILES, "families": list(FAMILIES)}


def _prose_stopwords() -> frozenset[str]:
    from .prose import STOPWORDS

    return STOPWORDS


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
    prose: bool = False  # found by its description's words (``named``), not by identifiers

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
    if state == "reproduced by the differential sweep":
        return (f"the fix PR ships no usable test; a differential-sweep cell that runs the changed code fails on "
                f"{before} and agrees on {after} — no entry yet")
    if state == "not detected by the grid":
        return "the fix PR ships no usable test, and the differential sweep's cells do not show the bug on CPU"
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
    found.sort(key=lambda m: (-len(m.named), m.pr or 0))
    if paste.has_traceback or paste.exceptions:  # an error is read for the names it shows; prose for its words
        return found
    rows = upstream_rows()
    by_pr = {str(row["pr"] or row["sha"]): row for row in rows}
    listed = {m.pr for m in found}
    for ranked in upstream_index(rows).rank(prose_text(shown)):
        row = by_pr[ranked.key]
        if ranked.score >= UPSTREAM_PROSE_SCORE and len(ranked.words) >= UPSTREAM_PROSE_WORDS and row["pr"] not in listed:
            note = ""
            if release and row["first_release"]:
                note = (f"DeepSpeed {release} predates this fix" if parse_version(release) < parse_version(row["first_release"])
                        else f"DeepSpeed {release} already has this fix")
            found.append(UpstreamMatch(row["pr"], row["subject"], row["component"], row["symptom"], row["first_release"],
                                       ranked.words, note, upstream_test_line(row), prose=True))
    return found


UPSTREAM_PROSE_SCORE, UPSTREAM_PROSE_WORDS = 10.0, 3  # a census row is one line: it takes more to name it


_UPSTREAM_INDEX: dict = {}


def upstream_index(rows: tuple[dict, ...]) -> "Index":
    """BM25 over the second tier's rows (:func:`fixes.prose.upstream_document`), made once per set of rows."""
    from .prose import Index, upstream_document

    if _UPSTREAM_INDEX.get("rows") is not rows:
        _UPSTREAM_INDEX.update(rows=rows, index=Index([str(row["pr"] or row["sha"]) for row in rows],
                                                       [upstream_document(row) for row in rows]))
    return _UPSTREAM_INDEX["index"]


def guess_component(text: str) -> str | None:
    """The component whose known upstream fixes the text's words rank first for, or None."""
    rows = upstream_rows()
    if not rows:
        return None
    ranked = upstream_index(rows).rank(prose_text(parse(text).text))
    by_pr = {str(row["pr"] or row["sha"]): row for row in rows}
    return by_pr[ranked[0].key]["component"] if ranked else None


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
