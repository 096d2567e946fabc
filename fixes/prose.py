"""Ranking a user's own words against what each entry states: BM25 for a symptom described in prose.

Most Fixbook bugs raise nothing: a user who has one writes what they see ("the loss of the first step is too high
after loading the checkpoint"). :func:`rank` scores such text against one document per entry, made of what the
entry states once (:class:`~fixes.fix.FixInfo`: title, summary, error text and symptom phrases, components, root
cause) with rank_bm25's Okapi BM25, the words reduced by a light stemmer (:func:`stem`) so that "gradients were
divided" meets "divides the gradient". The same documents for the known upstream fixes (a census row's subject and
note) rank the second tier. A prose match is never more than *possible* (:mod:`fixes.search` decides the level);
it names the words it matched.

The site runs the same ranking in the browser over the index :func:`site_index` writes (term frequencies, idf,
lengths, the stemmer's rules mirrored in ``docs/javascripts/error-match.js``); a browser test checks that both
answer every labelled query alike.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from .fix import FixInfo

K1, B, EPSILON = 1.5, 0.75, 0.25  # rank_bm25's BM25Okapi defaults, stated so the site uses the same
MIN_SCORE = 4.0  # a prose match below this is noise (a word or two that every entry has)
MIN_WORDS = 2  # distinct matched stems it takes
STOPWORDS = frozenset("""a an and are as at be been being but by can could did do does doing done for from had has have
having he her here hers him his how i if in into is it its itself just me more most my no nor not now of off on once
only or other our out over own same she should so some such than that the their them then there these they this
those through to too under until up very was we were what when where which while who whom why will with would you
your yours also after before again about above below any both each few further using use used via get got gets
deepspeed issue bug problem error hi thanks please help seems seem like one two see""".split())
# "ZeRO-3", "zero3", "ZeRO stage 3", "zero_optimization.stage=3", "stage: 3": one term, zero3 (a single digit
# alone is dropped as a word).
_STAGE = re.compile(r"\bzero[\s_-]*(?:optimization[\s._-]*)?(?:stage[\s_=:\"'-]*)?(\d)\b|\bstage[\s_=:\"'-]*(\d)\b",
                    re.IGNORECASE)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")
_WORD = re.compile(r"[A-Za-z0-9_]+")


def stem(word: str) -> str:
    """``gradients`` → ``gradient``, ``divided`` / ``divides`` / ``divide`` → ``divid``, ``zeroed`` → ``zero``:
    one suffix of -ing, -ed, -es, -s (never the -ss of ``loss``), then a final -e, on words of five letters or more."""
    if len(word) <= 4 or not word.isalpha():
        return word
    for suffix in ("ing", "ed", "es", "s"):
        if word.endswith(suffix) and not word.endswith("ss") and len(word) - len(suffix) >= 3:
            word = word[: -len(suffix)]
            break
    return word[:-1] if word.endswith("e") and len(word) > 4 else word


def tokens(text: str) -> list[str]:
    """The text's terms: each word lower-cased and stemmed; an identifier also gives its parts
    (``gradient_accumulation_steps`` → it and ``gradient``, ``accumulation``, ``step``; ``WarmupCosineLR`` → it and
    ``warmup``, ``cosine``, ``lr``); stop words and single letters dropped."""
    found: list[str] = []
    for match in _STAGE.finditer(text):
        found.append(f"zero{match.group(1) or match.group(2)}")
    for raw in _WORD.findall(text):
        parts = [p for piece in raw.split("_") for p in (_CAMEL.split(piece) if len(piece) >= 6 else [piece]) if p]
        for word in dict.fromkeys([raw, *parts] if len(parts) > 1 else [raw]):
            low = word.lower()
            if len(low) > 1 and low not in STOPWORDS:
                found.append(stem(low))
    return found


def entry_document(info: "FixInfo") -> str:
    """What an entry is known by, as one text: its title (twice: it is the shortest statement of the bug), summary,
    error text and symptom phrases, components and root cause."""
    return " ".join([info.title, info.title, info.summary, *info.error_signatures, *info.components, info.root_cause])


def upstream_document(row: dict) -> str:
    return " ".join([row["subject"], row.get("note", ""), row["component"]])


@dataclass(frozen=True)
class Ranked:
    key: str  # an entry id, or a census row's PR
    score: float
    words: tuple[str, ...]  # the query's words that matched (as the user wrote them)


class Index:
    """BM25 over documents, with the query's matched words kept for the answer."""

    def __init__(self, keys: Iterable[str], documents: Iterable[str]) -> None:
        from rank_bm25 import BM25Okapi

        self.keys = list(keys)
        self.documents = [tokens(text) for text in documents]
        self.bm25 = BM25Okapi(self.documents, k1=K1, b=B, epsilon=EPSILON)
        self._terms = [set(document) for document in self.documents]

    def rank(self, text: str) -> list[Ranked]:
        """Documents that share at least :data:`MIN_WORDS` terms with ``text`` and score :data:`MIN_SCORE` or more,
        best first (ties by key). Each query term counts once."""
        query: dict[str, str] = {}
        for raw in _WORD.findall(text):
            for term in tokens(raw):
                query.setdefault(term, raw)
        if not query:
            return []
        scores = self.bm25.get_scores(list(query))
        found = []
        for position, key in enumerate(self.keys):
            shared = [query[term] for term in query if term in self._terms[position]]
            score = float(scores[position])
            if len(set(shared)) >= MIN_WORDS and score >= MIN_SCORE:
                found.append(Ranked(key, round(score, 6), tuple(dict.fromkeys(shared))))
        return sorted(found, key=lambda r: (-r.score, r.key))

    def export(self) -> dict:
        """The index as the site's matcher reads it: the parameters, idf per term, each document's length and
        term frequencies (the same numbers rank_bm25 scores with)."""
        return {"k1": K1, "b": B, "avgdl": self.bm25.avgdl, "min_score": MIN_SCORE, "min_words": MIN_WORDS,
                "idf": dict(sorted(self.bm25.idf.items())),  # exact: JSON keeps every float as Python has it
                "docs": [{"key": key, "len": length, "tf": dict(sorted(freqs.items()))}
                         for key, length, freqs in zip(self.keys, self.bm25.doc_len, self.bm25.doc_freqs)]}


def site_index(entries: Index, upstream: Index) -> dict:
    """Both indexes and the tokenizer's constants, for ``docs/javascripts/error-match.js``."""
    return {"stopwords": sorted(STOPWORDS), "entries": entries.export(), "upstream": upstream.export()}
