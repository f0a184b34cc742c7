"""The query classifier: how much the lexical arm weighs in the fusion, and why, using the corpus and not only the
query's shape.

A query that holds a code the readable corpus knows in few chunks (three or more digits "30412", letters and
digits "42P07", snake_case "max_wal_senders", a version "1.2.3", "#1234") is an identifier query, even inside a
question: exact matching is the evidence that finds it, and the dense arm cannot tell "30412" from "30421".
Quantities are not codes: a one- or two-digit number ("20 weeks"), a decimal ("1.5"), a grouped number
("250,000"), a number with a unit ("400mg", "7-day-old"), or a number that many chunks hold ("2024"); nor are
two-character tokens ("A2"). Other questions lean dense; other queries weigh both evenly.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import datetime

import psycopg

IDENTIFIER_WEIGHT, QUESTION_WEIGHT, DEFAULT_WEIGHT = 0.7, 0.3, 0.5
# A code is rare when few readable chunks hold it: at most RARE_SHARE of them, or RARE_MIN_CHUNKS in a small corpus
# (where one document about AVX-039 may mention it in every section).
RARE_MIN_CHUNKS, RARE_SHARE = 10, 0.001

CODE_LIKE = re.compile(
    r"#\d+"                                                     # an issue or ticket number
    r"|(?<![\w.-])\d+(?:\.\d+){2,3}(?![\w.-])"                  # a version: 1.2.3 (1.5 is a quantity)
    r"|(?<![\w.-])\d{3,}(?![\w.-])"                             # a number of three or more digits
    r"|(?<![\w-])(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9]+(?:[-_/][A-Za-z0-9]+)*(?![\w-])"  # letters and digits
    r"|\b[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+\b")             # snake_case names
_UNITS = ("mg|g|kg|µg|ug|ng|ml|l|mm|cm|m|km|nm|µm|um|s|ms|h|hr|hrs|min|d|day|days|week|weeks|wk|month|months|year|"
          "years|yr|fold|x|mol|mmol|µmol|umol|iu|kda|bp|kb|mb|gb|tb|hz|khz|mhz|ghz|v|mv|kv|w|kw|mw|gy|percent")
_QUANTITY = re.compile(rf"^\d+(?:[.,]\d+)*-?(?P<unit>{_UNITS})(?:-[a-z]+)*$", re.I)  # 400mg, 7-day-old, 3-fold
_ORDINAL = re.compile(r"^\d+(?:st|nd|rd|th)$", re.I)
RARE_SHORT_CHUNKS = 3  # a two-character code ("0B") is often part of a name ("cyclin A2"): it must be rarer
_QUESTION = re.compile(r"^\s*(how|why|what|when|which|who|where|explain|describe|can|could|should|does|do|is|are)\b",
                       re.I)

# For each code-like token: its lexemes with their document frequency and posting count over the readable sources,
# live or as of a time (sql/functions/lexical.sql).
CODE_TERMS = """
SELECT t.token, u.lexeme, coalesce(s.df, 0), coalesce(s.postings, 0)
FROM unnest(%(tokens)s::text[]) AS t(token)
CROSS JOIN LATERAL unnest(kb_lexemes(t.token)) AS u
LEFT JOIN LATERAL kb_term_stats(ARRAY[u.lexeme], %(source_keys)s, %(as_of)s) AS s ON true
"""
READABLE_CHUNKS = "SELECT kb_readable_chunks(%(source_keys)s, %(as_of)s)"


@dataclass
class QueryClass:
    kind: str  # "identifier" | "question" | "keywords"
    lexical_weight: float  # the RRF weight of the lexical arm; the dense arm gets 1 - this
    reason: str
    identifiers: list[str] = field(default_factory=list)  # the query's rare codes
    identifier_terms: list[str] = field(default_factory=list)  # their rarest lexemes: what holding the code means

    def as_dict(self) -> dict:
        return asdict(self)


def is_quantity(token: str) -> bool:
    """A number with a unit ("400mg", "30s", "7-day-old") or an ordinal ("32nd"). A single capital letter after a
    number is a code, not a unit ("2200M")."""
    match = _QUANTITY.match(token)
    if match:
        return len(match["unit"]) > 1 or match["unit"].islower()
    return _ORDINAL.match(token) is not None


def code_shaped(token: str, query: str) -> bool:
    """Not a quantity, and at least two characters."""
    if token.startswith("#"):
        return True
    if is_quantity(token):
        return False
    if token.isdigit() and re.search(rf"\d,{token}|{token},\d", query):  # part of 250,000
        return False
    return len(re.sub(r"[^A-Za-z0-9]", "", token)) >= 2


def classify(conn: psycopg.Connection, query: str, source_keys: list[int], lexical_weight: float | None = None,
             as_of: datetime | None = None) -> QueryClass:
    """The query's class and lexical weight (`lexical_weight` overrides the weight, never the codes found), from the
    statistics of the readable sources, as they were at `as_of` for a read of the past."""
    tokens = sorted({t for t in CODE_LIKE.findall(query) if code_shaped(t, query)})
    identifiers, terms, common = [], [], []
    if tokens:
        stats = {"source_keys": source_keys, "as_of": as_of}
        chunks = conn.execute(READABLE_CHUNKS, stats).fetchone()[0]
        rare_at = max(RARE_MIN_CHUNKS, RARE_SHARE * chunks)
        lexemes: dict[str, list[tuple[int, int, str]]] = {}
        for token, lexeme, df, postings in conn.execute(CODE_TERMS, {"tokens": tokens, **stats}):
            lexemes.setdefault(token, []).append((int(postings), int(df), lexeme))
        for token in tokens:
            known = sorted(entry for entry in lexemes.get(token, []) if entry[0] > 0)
            whole = [entry for entry in known if entry[2] == re.sub(r"[^a-z0-9]", "", token.lower())]
            term = (whole or known)[:1]  # the whole code in compact form ("m2phenotype"), not a part ("m2")
            short = len(re.sub(r"[^A-Za-z0-9]", "", token)) <= 2
            if term and term[0][0] <= (RARE_SHORT_CHUNKS if short else rare_at):  # few chunks: it points somewhere
                identifiers.append(token)
                terms.append(term[0][2])
            elif known:
                common.append(token)
    if identifiers:
        kind, weight = "identifier", IDENTIFIER_WEIGHT
        reason = f"{', '.join(identifiers)}: a code in few readable chunks, so exact matches lead"
    elif _QUESTION.match(query) or query.rstrip().endswith("?"):
        kind, weight = "question", QUESTION_WEIGHT
        reason = "a natural-language question: meaning (dense) leads" + (
            f" ({', '.join(common)} too common to be a code)" if common else "")
    else:
        kind, weight = "keywords", DEFAULT_WEIGHT
        reason = "keywords: both arms weigh the same" + (f" ({', '.join(common)} too common to be a code)" if common else "")
    if lexical_weight is not None:
        weight, reason = lexical_weight, f"lexical weight {lexical_weight:g} given by the caller; the classifier said: {reason}"
    return QueryClass(kind, weight, reason, identifiers, terms)
