"""The evidence an answer stands on (issue 19): how much of the question's rare vocabulary the contexts hold, the
codes they hold verbatim, the sentences that can answer, and the calibrated confidence that decides whether kb
answers at all.

One dense cosine cannot tell a paraphrased answerable question from an off-topic one: an off-topic question still
finds paragraphs about the same kind of thing, at cosines answerable questions also get. What it lacks is the
words: a question about the Lyon plant's fire drills names "Lyon" and "drill", which nothing in the knowledge base
holds. So words are weighed by how rare they are in what the caller may read (BM25's idf over the same lexemes
the lexical arm indexes, `kb_lexemes`), and a context's lexical evidence is the share of that weight it holds,
its section heading included. The weights below were fitted on SQuAD 2.0 questions (crowd-written, with
unanswerable ones) by bench/answer_calibration.py and checked on held-out ones: bench/README.md. Since issue 31
they are the default only: each knowledge base fits its own (calibration.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from datetime import datetime

import numpy as np
import psycopg

from pipelines.ingest.sentences import split_sentences
from pipelines.retrieval.query_class import CODE_LIKE, READABLE_CHUNKS, code_shaped

# Confidence that the contexts answer the question: a logistic model of (the best context's cosine, the best
# context's lexical evidence, the lexical evidence of the context the dense arm ranks first, the score of the best
# sentence of the first contexts under SENTENCE_WEIGHTS), fitted on answerable against out-of-corpus calibration
# questions. The best sentence is the evidence that tells a question about a left-out paragraph of an ingested
# article from an answerable one: both find paragraphs of the article, only the answerable one a sentence holding
# its words near its meaning. (The negative weight on the best context's lexical evidence is the fit's: with the
# best sentence in the model, that evidence counts through it and through the dense top context.) kb answers at
# ANSWER_AT or above, or when a context holds the question's codes. ANSWER_AT is the operating point chosen for the
# goals as stated (bench/README.md): the highest threshold, in steps of 0.05, at which the cross-validated
# calibration curve still cites the gold passage for 85% of answerable questions and refuses 95% of the questions
# about an article that is not ingested (all of them from 0.1 up). Every step down answers more answerable
# questions and refuses fewer about left-out paragraphs, and fewer of the unanswerable questions written against
# the very paragraph that almost answers them: 0.2 refuses half of the former and a tenth of the latter.
CONFIDENCE_WEIGHTS = (-7.01, 1.32, -2.56, 2.79, 1.33)  # bias, then FEATURES
FEATURES = ("dense", "lexical", "lexical_of_dense_top", "best_sentence")
ANSWER_AT = 0.2
# Since issue 31 these are the default only: each knowledge base fits its own weights and operating point per
# embedding model, on probes built from its chunks (pipelines/answers/calibration.py); a scope too small to fit
# (or not yet fitted) is answered with these, and says so.
# A sentence's score (a logit): its cosine to the question, its lexical evidence (with its heading), its context's
# cosine and its context's lexical evidence. The negative weight on the context's cosine is what the fit found:
# among sentences equally close to the question, the one that stands out from its paragraph is the answer.
SENTENCE_WEIGHTS = (6.85, 2.51, -3.34, 2.69)
# The code rule's floor: a context holding the question's codes answers when it also holds this share of the
# question's rare vocabulary (a judgement, not fitted: SQuAD has too few code questions to fit it on).
CODE_COVERAGE = 0.5
CARD_MATCH = 0.7  # a Q&A card whose question is at least this close to the question answers with its answer
SUPPORT_MIN = 0.6  # a claim is supported by a context holding this share of its words, and each of its numbers

QUESTION_TERMS = """
SELECT u.lexeme, coalesce(s.df, 0)::float8
FROM unnest(tsvector_to_array(kb_lexemes(%(question)s))) AS u(lexeme)
LEFT JOIN kb_term_stats(tsvector_to_array(kb_lexemes(%(question)s)), %(source_keys)s, %(as_of)s) AS s ON s.term = u.lexeme
"""
TEXT_LEXEMES = ("SELECT tsvector_to_array(kb_lexemes(t)) FROM unnest(%s::text[]) WITH ORDINALITY AS u(t, n)"
                " ORDER BY n")
_QUESTION_LINE = re.compile(r"^\s*(?:\*\*)?(?:Q|Question)\s*[:.)]", re.I)
_ANSWER_LABEL = re.compile(r"^\s*(?:\*\*)?(?:A|Answer)\s*[:.)]\s*(?:\*\*)?\s*", re.I)
# What a sentence says it set out to find, not what it found: a reported question ("to determine whether X", "it is
# unclear whether Y"), a study's aim ("the purpose of this study was to ...", "we sought to ...") or a line labelled
# as one ("Objective: To assess ..."). It shares most words with a yes/no question and so ranks first, yet decides
# nothing. The verbs are a study's, in their verb forms only ("analysts", "Study leave", "Test accounts" are not);
# "if" counts right after one with "to" or "we" ("to test if"), never as a condition ("assessed if X is missing");
# an aim is a study's, paper's or report's, or one of finding out ("The purpose of this policy is to allow remote
# work" answers).
_STUDIES = r"(?:study|studies|paper|report|trial|survey|review|research|work|project|pilot|analysis|experiment)"
_INQUIRY = (r"(?:determine[sd]?|determining|assess(?:e[sd])?|assessing|evaluate[sd]?|evaluating|investigate[sd]?|"
            r"investigating|examine[sd]?|examining|test(?:s|ed)?|testing|explore[sd]?|exploring|establish(?:e[sd])?|"
            r"establishing|ascertain(?:s|ed)?|ascertaining|clarify|clarified|clarifying|study|studied|studying)")
_SOUGHT = re.compile(
    rf"\b{_INQUIRY}\b(?:\s+[\w,-]+){{0,3}}?\s+whether\b|\b(?:to|we)\s+{_INQUIRY}\s+if\b"
    r"|\b(?:unclear|unknown|uncertain|not\s+known|question\s+(?:of\s+)?)\s*(?:whether|if)\b"
    rf"|\b(?:aims?|purposes?|objectives?|goals?)\s+of\s+(?:this|the|our|that|these)\s+(?:\w+\s+)?{_STUDIES}s?\b"
    r"(?:\s+\S+){0,4}?\s+(?:is|was|were|are)\s+to\b"
    rf"|\b(?:aims?|purposes?|objectives?|goals?)\s+(?:is|was|were|are)\s+to\s+{_INQUIRY}\b"
    rf"|\b(?:we|(?:this|the|our)\s+(?:\w+\s+)?{_STUDIES})\s+(?:sought|aimed|aims|seeks|set\s+out|intended)\s+to\b"
    rf"|\b(?:this|the|our)\s+(?:\w+\s+)?{_STUDIES}\s+(?:is|was)\s+(?:performed|conducted|designed|undertaken)\s+to\b"
    rf"|^\W*(?:study\s+)?(?:aims?|purposes?|objectives?|goals?)\s*[:\u2013\u2014-]\s*"
    rf"(?:to\s+\w+|we\b|(?:this|the)\s+{_STUDIES}\b)"
    rf"|^\W*[A-Za-z ]{{2,30}}:\s*(?:\(\w+\)\s*)?to\s+{_INQUIRY}\b",
    re.I)
# ... unless it goes on to say what was found: "We tested whether it restores: it does", "..., and it was".
_FOUND = re.compile(r"(?:[;:]|\s[-\u2013\u2014]+|,\s*(?:and|but|so))\s+(?:it|they|there|we|he|she|yes|no)\b"
                    r"|\b(?:found|showed|revealed|concluded|confirmed)\s+that\b", re.I)
# A verdict opening a reply or a sentence ("Yes, ...", "No."), with what follows it up to the next word.
YES_OR_NO = re.compile(r"^\W*(yes|no)\b[\s,.:;!-]*", re.I)
_TOKEN = re.compile(r"[A-Za-z0-9]+(?:[-_./#][A-Za-z0-9]+)*")
_DIGITS = re.compile(r"\d+(?:[.,]\d+)*")


def question_terms(conn: psycopg.Connection, question: str, source_keys: list[int],
                   as_of: datetime | None = None) -> dict[str, float]:
    """The question's lexemes weighted by their idf over the readable chunks (as they were at `as_of` for a read of
    the past): a word no readable chunk holds weighs the most, a word most chunks hold almost nothing."""
    stats = {"source_keys": source_keys, "as_of": as_of}
    chunks = conn.execute(READABLE_CHUNKS, stats).fetchone()[0]
    rows = conn.execute(QUESTION_TERMS, {"question": question, **stats}).fetchall()
    return {lexeme: math.log(1 + (chunks - df + 0.5) / (df + 0.5)) for lexeme, df in rows}


def lexemes(conn: psycopg.Connection, texts: list[str]) -> list[set[str]]:
    """Each text's lexemes as the lexical arm indexes them (stems, and identifiers in compact form)."""
    if not texts:
        return []
    return [set(row[0] or ()) for row in conn.execute(TEXT_LEXEMES, (texts,)).fetchall()]


def coverage(terms: dict[str, float], held: set[str]) -> float:
    """The share of the question's term weight that a text holds."""
    total = sum(terms.values())
    return sum(w for t, w in terms.items() if t in held) / total if total else 0.0


def question_codes(question: str) -> list[str]:
    return sorted({t for t in CODE_LIKE.findall(question) if code_shaped(t, question)})


def _compact(token: str) -> str:
    return re.sub(r"[^a-z0-9]", "", token.lower())


def holds_code(text: str, code: str) -> bool:
    """The text holds the whole code as a token ("ERR-5012", not "ERR-7781"; "backtrace_functions", not "functions")."""
    return _compact(code) in {_compact(t) for t in _TOKEN.findall(text)}


def held_instead(text: str, code: str) -> str | None:
    """A code of the same make that the text holds in place of `code` ("HR-2024-047" for "HR-2024-048": the same
    letters and separators, as many digits, other ones), or None. Only an identifier has a make: letters and at
    least three digits ("ERR-5012", "42P07"; not "5pm", "x86", "COVID-19", a year or a number). A text that holds
    the code in any spelling ("HR 2024-047", "ISO 27001", a Unicode hyphen) or within a longer one ("python3" in
    "python3.11") holds it: only a make that differs is evidence that the documents speak of another."""
    identifier = re.search(r"[A-Za-z]", code) and sum(c.isdigit() for c in code) >= 3
    if not identifier or _compact(code) in _compact(text):
        return None
    make = _make(code)
    return next((t for t in _TOKEN.findall(text) if _make(t) == make), None)


def _make(token: str) -> str:
    return re.sub(r"\d", "0", token.lower())  # digit for digit: "COVID-19" is not of "COVID-2019"


def states_what_is_sought(sentence: str) -> bool:
    """The sentence states a question or an aim (_SOUGHT) rather than an answer: never the one that decides a yes/no
    question, though it repeats its words. One that goes on to say what was found ("We tested whether it restores:
    it does", "... and found that ...") answers."""
    if YES_OR_NO.match(sentence):
        return False
    sought = _SOUGHT.search(sentence)
    return sought is not None and _FOUND.search(sentence, sought.end()) is None


def is_question_sentence(sentence: str) -> bool:
    """A question is never an answer: a line that ends with "?" or is labelled Q:/Question:."""
    return sentence.rstrip(" *_").endswith("?") or _QUESTION_LINE.match(sentence) is not None


def _units(text: str) -> list[str]:
    """A context's lines, each split into sentences; a table (lines of `cell | cell`, the header first, as the chunker
    writes them) gives one unit per row, each cell named by its header ("Paid weeks: 20"): a bare row says little."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1 and all(" | " in line for line in lines):
        header = [cell.strip() for cell in lines[0].split("|")]
        return ["; ".join(f"{h}: {c.strip()}" if h else c.strip() for h, c in zip(header, row.split("|")))
                for row in lines[1:]]
    return [s for line in lines for s in split_sentences(line) or [line]]


@lru_cache(maxsize=4096)
def answer_sentences(text: str) -> tuple[str, ...]:
    """The sentences (or table rows) of a context that may answer: no questions, "A:" labels removed. Cached: the
    same chunks come back question after question (a calibration's probes, a busy server)."""
    out = []
    for sentence in _units(text):
        if not is_question_sentence(sentence):
            sentence = _ANSWER_LABEL.sub("", sentence).strip()
            if sentence:
                out.append(sentence)
    return tuple(out)


@dataclass
class Candidate:
    """A sentence that may answer, with the evidence for it."""
    text: str
    context: int  # its context's number
    similarity: float = 0.0  # cosine to the question
    coverage: float = 0.0  # lexical evidence, its context's heading included
    context_similarity: float = 0.0
    context_coverage: float = 0.0
    score: float = 0.0

    def features(self) -> list[float]:
        return [self.similarity, self.coverage, self.context_similarity, self.context_coverage]


def score_candidates(candidates: list[Candidate], sentence_vectors: np.ndarray,
                     question_vector: np.ndarray) -> list[Candidate]:
    """Each candidate scored (SENTENCE_WEIGHTS), best first."""
    similarities = sentence_vectors @ question_vector if len(candidates) else []
    for candidate, similarity in zip(candidates, similarities):
        candidate.similarity = float(similarity)
        candidate.score = float(np.dot(SENTENCE_WEIGHTS, candidate.features()))
    return sorted(candidates, key=lambda c: -c.score)


def numbers(text: str) -> set[str]:
    return set(_DIGITS.findall(text))


def support(claim_lexemes: set[str], claim: str, context_lexemes: set[str], context_text: str) -> float:
    """How far a context says what a claim says: the share of the claim's lexemes it holds, and 0 when the claim
    has a number the context lacks (a model's invented figure)."""
    if numbers(claim) - numbers(context_text):
        return 0.0
    return len(claim_lexemes & context_lexemes) / len(claim_lexemes) if claim_lexemes else 0.0
