"""Search: dense (pgvector HNSW), lexical (BM25 in PostgreSQL) and their weighted RRF fusion, in one query.

See sql/queries/hybrid_search.sql. Filters apply inside both arms, so a selective filter still yields k results
(the dense arm uses pgvector's iterative index scans to keep going past filtered-out rows).

Access comes first: the caller's groups decide which sources it may read, and everything after that (both arms,
BM25 statistics, candidate pruning, fusion) works on those sources alone, so nothing a caller sees depends on
documents it cannot read.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass, field
from datetime import date, datetime, timezone

import numpy as np
import psycopg
from psycopg import sql

from pipelines.ingest.cards import CARD_KIND as CARD
from pipelines.ingest.clean import normalise
from pipelines.ingest.decoding import without_controls
from pipelines.models.embedders import Embedder
from pipelines.retrieval.query_class import QueryClass, classify
from pipelines.retrieval.readable import DOCUMENTS as READABLE_DOCUMENTS
from pipelines.retrieval.readable import Readable, readable
from pipelines.settings import SQL_DIR
from pipelines.storage.vectors import vector_table

HYBRID = (SQL_DIR / "queries" / "hybrid_search.sql").read_text()
# HNSW candidate list: recall@100 of the dense arm 0.990 of exact search at 200 on SciFact's 10.5k chunks (0.964
# at 100); larger over-fetches get twice their size (bench/dense_recall.py). pgvector caps it at 1000.
EF_SEARCH = 200
MAX_SCAN_TUPLES = 100_000  # how far an iterative scan may go under a selective filter
RRF_K = 60
# Anserini's BM25 defaults (the BEIR baselines); not tuned on any split here. On SciFact train they give
# lexical nDCG@10 0.695 against 0.690 for the textbook k1 1.2, b 0.75 (bench/README.md).
BM25_K1, BM25_B = 0.9, 0.4
# Lexical pruning (sql/queries/hybrid_search.sql): the query terms with the shortest posting lists, together at
# most POSTING_BUDGET postings, nominate candidates (a lone common term reads only its best POSTING_BUDGET
# postings); the best RESCORE_MIN (or 10x the over-fetch) candidates are completed with the other terms. On
# SciFact this returns exactly the rankings of unpruned BM25; it bounds the lexical arm's work at any corpus size
# (bench/README.md). Postings are read per readable source, and as of a time when one is asked.
POSTING_BUDGET = 10_000
RESCORE_MIN = 200
# Terms in more than this share of the readable chunks' texts carry no evidence and are left out (None: keep
# every term; Lucene's idf is never negative, so a common term only adds little).
COMMON_SHARE: float | None = None
# A filter (format, dates, entities) that matches at most this many chunks is searched chunk by chunk, exactly,
# in both arms; a broader one keeps the indexes, with exact BM25 under it.
FILTER_FIRST_MAX = 20_000
# Fused scores closer than this share are a near-tie: RRF knows only ranks, so the arms' own scores (normalised
# over the candidates and weighted like the fusion) decide their order.
TIE_SHARE = 0.01
ARMS = ("hybrid", "dense", "lexical")
# Search modes and the Q&A cards each reads (pipelines/ingest/cards.py): chunks only, cards only, or cards ahead of chunks.
MODES = {"chunks": "exclude", "qa_only": "only", "qa_first": "include"}


@dataclass
class Filters:
    source_id: str | None = None
    doc_format: str | None = None
    date_from: date | None = None
    date_to: date | None = None
    entities: dict | None = None  # JSONB containment, e.g. {"codes": ["AVX-039"]}
    metadata: dict | None = None  # the document's metadata holds these (a table source's metadata columns)
    groups: list[str] = field(default_factory=list)  # the caller's groups: restricted sources need one of them
    as_of: datetime | None = None
    cards: str = "exclude"  # Q&A cards: "exclude" (chunks only), "only" (cards only) or "include" (both)
    duplicates: bool = False  # also a chunk whose text a better-ranked result already shows (else listed as its copy)
    # (source_id, locator) of documents read as if they were not there: an answer calibration probe about a document
    # the knowledge base does not hold (pipelines/answers/calibration.py). It only ever narrows what is read.
    left_out: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.as_of is not None and self.as_of.tzinfo is None:  # a time without a zone is UTC, for every caller
            self.as_of = self.as_of.replace(tzinfo=timezone.utc)

    def readable(self, conn: psycopg.Connection) -> Readable:
        """What these filters read: the caller's sources (readable.py), less the documents left out."""
        visible = readable(conn, self.groups, self.source_id, self.as_of)
        return dataclasses.replace(visible, hidden=visible.hidden + self.left_out) if self.left_out else visible

    @property
    def narrows(self) -> bool:
        """True when the filters may exclude most of a source's chunks, which pruned BM25 could then miss.
        (Sources, and so access groups and source filters, are applied before pruning; as-of reads prune over the
        postings of chunks valid at that time.)"""
        return self.cards == "only" or any(getattr(self, name) is not None
                                           for name in ("doc_format", "date_from", "date_to", "entities", "metadata"))

    def predicate(self) -> tuple[sql.Composable, dict]:
        """The chunk filter both arms apply; what the caller may read is filled in from `Readable.params()`."""
        parts = [sql.SQL("c.valid_to IS NULL") if self.as_of is None else
                 sql.SQL("c.valid_from <= %(as_of)s AND (c.valid_to IS NULL OR c.valid_to > %(as_of)s)"),
                 READABLE_DOCUMENTS]
        if self.cards != "include":
            parts.append(sql.SQL("c.kind = 'card'") if self.cards == "only" else sql.SQL("c.kind <> 'card'"))
        params: dict = {"as_of": self.as_of}
        optional = {
            "doc_format": "d.doc_format = %(doc_format)s",
            "date_from": "d.doc_date >= %(date_from)s",
            "date_to": "d.doc_date <= %(date_to)s",
            "entities": "c.entities @> %(entities)s",
            "metadata": "d.metadata @> %(metadata)s",
        }
        for name, clause in optional.items():
            value = getattr(self, name)
            if value is not None:
                parts.append(sql.SQL(clause))
                params[name] = value
        return sql.SQL(" AND ").join(parts), params


def metadata_filter(pairs: list[str] | tuple[str, ...] | None) -> dict | None:
    """`column=value` pairs (`kb search --where`, the API's `where`) as the metadata a document must hold. A value
    that reads as JSON is that value (`priority=2` matches the number 2, `open=true` a boolean), else it is text."""
    if not pairs:
        return None
    wanted = {}
    for pair in pairs:
        column, equals, value = pair.partition("=")
        if not equals or not column.strip():
            raise ValueError(f"where {pair!r}: expected column=value, such as product=network")
        try:
            wanted[column.strip()] = json.loads(value)
        except ValueError:
            wanted[column.strip()] = value
    return wanted


@dataclass
class Hit:
    chunk_id: int
    source: str
    document: str
    title: str | None
    section_path: list[str]
    content: str
    entities: dict
    doc_format: str
    doc_date: date | None
    score: float  # the fused (RRF) score
    dense_rank: int | None = None
    dense_score: float | None = None  # cosine similarity to the query, for every candidate
    lexical_rank: int | None = None
    lexical_score: float | None = None  # BM25, for every candidate
    dense_rrf: float = 0.0  # each arm's share of the fused score
    lexical_rrf: float = 0.0
    matched_terms: list[str] = field(default_factory=list)  # the query's lexemes this chunk holds
    exact: list[str] = field(default_factory=list)  # the query's codes this chunk holds
    tie_broken: bool = False  # moved within a near-tie by the arms' own scores
    kind: str = "text"  # text, table, or card (a Q&A card: content is its answer)
    question: str | None = None  # a card's question
    source_chunk_id: int | None = None  # a card's source chunk: what citations point at
    page: int | None = None  # the page the chunk starts on (PDFs and other paged formats)
    copies: list[str] = field(default_factory=list)  # other places (source:path p. N > section) of this text, not shown
    highlights: list[tuple[int, int]] = field(default_factory=list)  # character spans of matched words in content

    EXPLANATION = ("dense_rank", "dense_score", "lexical_rank", "lexical_score", "dense_rrf", "lexical_rrf",
                   "matched_terms", "exact", "tie_broken", "highlights")

    def as_dict(self, debug: bool = False) -> dict:
        data = asdict(self)
        if not debug:
            for key in self.EXPLANATION:
                data.pop(key)
        return data


class QueryEmbeddingError(RuntimeError):
    pass


def embed_query(embedder: Embedder, query: str) -> np.ndarray:
    """The query's vector, refused (not searched with) when the model returns garbage: NaN scores rank nothing."""
    from pipelines.ingest.embed import invalid_vectors

    vectors = embedder.embed([query])
    if problem := invalid_vectors(vectors, 1, embedder.dimensions).get(0):
        raise QueryEmbeddingError(f"cannot search: {problem} for the query ({embedder.model_key})")
    return vectors[0]


def _prepare(conn: psycopg.Connection, candidates: int) -> None:
    """The session's HNSW settings for this search, in one round trip."""
    ef_search = min(max(EF_SEARCH, 2 * candidates), 1000)
    conn.execute("SELECT set_config('hnsw.ef_search', %s, false), set_config('hnsw.iterative_scan', 'relaxed_order', false),"
                 " set_config('hnsw.max_scan_tuples', %s, false)", (str(ef_search), str(MAX_SCAN_TUPLES)))


WITHIN = "SELECT c.chunk_id FROM chunks c JOIN documents d ON d.document_id = c.document_id WHERE {} LIMIT %(limit)s"


# The oldest live chunk's time, compared outside the scan: min() reads one entry of chunks_live_since whatever the
# plan, where `EXISTS (... AND valid_from <= $1)` under a generic plan may scan the whole table for a time before
# every live chunk (30 ms at 100k chunks once sql/014 made the table small enough for a scan to look cheap).
LIVE_AT = "SELECT coalesce((SELECT min(valid_from) FROM chunks WHERE valid_to IS NULL) <= %s, false)"


def _live_at(conn: psycopg.Connection, as_of: datetime | None) -> bool:
    """Whether any chunk live today was already written at `as_of` (chunks_live_since): if none was, an as-of read
    skips the live postings and reads only the history's."""
    return as_of is None or conn.execute(LIVE_AT, (as_of,)).fetchone()[0]


def _within(conn: psycopg.Connection, filters: Filters, predicate: sql.Composable, params: dict) -> list[int] | None:
    """The chunks a narrowing filter matches, when they are few enough to score one by one (None otherwise)."""
    if not filters.narrows:
        return None
    rows = conn.execute(sql.SQL(WITHIN).format(predicate), {**params, "limit": FILTER_FIRST_MAX + 1}).fetchall()
    return [r[0] for r in rows] if len(rows) <= FILTER_FIRST_MAX else None


def normalised_query(query: str) -> str:
    """A query read as the chunks were (pipelines/ingest/decoding.py, clean.py): terminal codes and control characters
    dropped, ligatures spelled out, full-width letters ASCII ("ﬁle" finds "file", "ＨＲ－２０２４－０４７" the code)."""
    return normalise(without_controls(query))


def search_explained(conn: psycopg.Connection, embedder: Embedder, query: str, k: int = 5, *, arm: str = "hybrid",
                     lexical_weight: float | None = None, k_overfetch: int = 20, filters: Filters | None = None,
                     model_key: str | None = None, vector: np.ndarray | None = None,
                     exact_first: bool = True, mode: str = "chunks") -> tuple[QueryClass, list[Hit]]:
    """Top-k chunks for a query, and how the query was read. `arm` picks dense, lexical or both fused;
    lexical_weight None lets the query classifier choose. With exact_first, a chunk holding a code the query asks
    about is never ranked below one that does not. `mode` reads chunks, Q&A cards, or both with the cards that
    make the top k ahead of the chunks. `vector` is the query's embedding when the caller has it."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}")
    if lexical_weight is not None and not 0 <= lexical_weight <= 1:
        raise ValueError("lexical_weight must be between 0 and 1")
    query = normalised_query(query)
    filters = dataclasses.replace(filters or Filters(), cards=MODES[mode])
    visible = filters.readable(conn)
    query_class = classify(conn, query, visible.keys, {"dense": 0.0, "lexical": 1.0}.get(arm, lexical_weight),
                           filters.as_of)
    if not visible.sources:
        return query_class, []
    n = max(k_overfetch, k)
    if vector is None:
        vector = embed_query(embedder, query) if arm != "lexical" else np.zeros(embedder.dimensions, dtype=np.float32)
    predicate, params = filters.predicate()
    params.update(visible.params())
    within = _within(conn, filters, predicate, params)
    statement = sql.SQL(HYBRID).format(vectors=vector_table(conn, model_key or embedder.model_key), filters=predicate)
    _prepare(conn, n)
    pruned = not filters.narrows  # (a narrowing filter is searched chunk by chunk or exactly)
    rows = conn.execute(statement, {
        **params, "source_keys": visible.keys, "within": within,
        "live_at_as_of": _live_at(conn, filters.as_of),
        "query": query, "vector": vector, "rrf_k": RRF_K, "lexical_weight": query_class.lexical_weight,
        "dense_n": n if arm != "lexical" else 0, "lexical_n": n if arm != "dense" else 0,
        "bm25_k1": BM25_K1, "bm25_b": BM25_B, "common_share": COMMON_SHARE,
        "posting_budget": POSTING_BUDGET if pruned else None,
        "rescore_n": max(RESCORE_MIN, 10 * n) if pruned else None,
    }).fetchall()
    hits = [Hit(*row) for row in rows]
    if arm == "hybrid":
        hits = arrange(hits, query_class, exact_first)
    if not filters.duplicates:
        hits = distinct(hits)
    if mode == "qa_first":
        hits = _cards_first(hits, k)
    return query_class, hits[:k]


def cited(where: str, page: int | None) -> str:
    """A place as results, copies and citations name it: `handbook:manual.pdf p. 16` (a page when it has one)."""
    return f"{where} p. {page}" if page else where


def distinct(hits: list[Hit]) -> list[Hit]:
    """The hits without the repeats of a text a better-ranked hit of the same kind shows (a disclaimer on every
    document, a site's footer, one file under two paths), whatever its spacing: each repeat is listed in that hit's
    `copies` (document, page and section), so boilerplate never fills a result list and the copies stay findable.
    A card and the chunk it was made from are not copies of each other. The candidates are the over-fetched ones:
    a list that copies thin out can hold fewer than k."""
    kept: list[Hit] = []
    first: dict[tuple[str, str], Hit] = {}
    for hit in hits:
        text = (hit.kind, " ".join(hit.content.split()))
        if text in first:
            first[text].copies.append(cited(f"{hit.source}:{hit.document}", hit.page)
                                      + (f" > {' > '.join(hit.section_path)}" if hit.section_path else ""))
        else:
            first[text] = hit
            kept.append(hit)
    return kept


def _cards_first(hits: list[Hit], k: int) -> list[Hit]:
    """qa_first: the cards among the top k that match the query at least as closely in meaning as the best chunk
    there go ahead of the chunks (in their order); a card that merely made the list stays where it ranked."""
    top = hits[:k]
    best_chunk = max((h.dense_score for h in top if h.kind != CARD and h.dense_score is not None), default=-1.0)
    ahead = [h for h in top if h.kind == CARD and (h.dense_score or -1.0) >= best_chunk]
    return ahead + [h for h in top if h not in ahead] + hits[k:]


def search(conn: psycopg.Connection, embedder: Embedder, query: str, k: int = 5, **options) -> list[Hit]:
    """Top-k chunks for a query (see search_explained)."""
    return search_explained(conn, embedder, query, k, **options)[1]


def arrange(hits: list[Hit], query_class: QueryClass, exact_first: bool = True) -> list[Hit]:
    """The final order of fused candidates (sorted by fused score). Near-ties (fused scores within TIE_SHARE) are
    ordered by the arms' own scores, min-max normalised over the candidates and weighted like the fusion: RRF
    keeps only ranks, and near a tie the score margins are the evidence left. Then, with exact_first, chunks that
    hold more of the query's codes come first, each group keeping that order."""
    weight = query_class.lexical_weight
    evidence = [(1 - weight) * d + weight * lx for d, lx in zip(_normalised([h.dense_score for h in hits]),
                                                                  _normalised([h.lexical_score for h in hits]))]
    ordered: list[Hit] = []
    group: list[tuple[Hit, float]] = []
    for hit, strength in zip(hits, evidence):
        if group and hit.score < group[0][0].score * (1 - TIE_SHARE):
            ordered += _by_evidence(group)
            group = []
        group.append((hit, strength))
    ordered += _by_evidence(group)
    for hit in ordered:
        hit.exact = [code for code, term in zip(query_class.identifiers, query_class.identifier_terms)
                     if term in hit.matched_terms]
    if exact_first and query_class.identifier_terms:
        ordered.sort(key=lambda h: -len(h.exact))  # stable: the order above holds within each group
    return ordered


def _normalised(values: list[float | None]) -> list[float]:
    present = [v for v in values if v is not None]
    low, high = (min(present), max(present)) if present else (0.0, 0.0)
    return [0.0 if v is None or high == low else (v - low) / (high - low) for v in values]


def _by_evidence(group: list[tuple[Hit, float]]) -> list[Hit]:
    reordered = sorted(group, key=lambda pair: -pair[1])
    for (before, _), (after, _) in zip(group, reordered):
        if before is not after:
            after.tie_broken = True
    return [hit for hit, _ in reordered]


def dense_search(conn: psycopg.Connection, embedder: Embedder, query: str, k: int = 5,
                 as_of: datetime | None = None) -> list[Hit]:
    return search(conn, embedder, query, k, arm="dense", k_overfetch=k, filters=Filters(as_of=as_of))


_WORD = re.compile(r"[A-Za-z0-9]+(?:[-_./][A-Za-z0-9]+)*|\w+")


def _code_word(word: str) -> bool:
    return any(ch.isdigit() for ch in word) or any(sep in word for sep in "-_./")


def _compact(word: str) -> str:
    return re.sub(r"[^a-z0-9]", "", word.lower())


def add_highlights(conn: psycopg.Connection, hits: list[Hit], query: str) -> None:
    """Mark the words of each hit's content that are the query's terms, as character spans for the console: a
    code-like word ("ERR-5012", "max_wal_senders") when it is one of the query's codes, whole; any other word
    when it shares a stem with one of the query's plain words. The parts of a code are not the query's words: an
    ERR-5012 query does not mark ERR-7781 through "err", nor "senders" through max_wal_senders."""
    asked = [m.group() for m in _WORD.finditer(query)]
    codes = {_compact(w) for w in asked if _code_word(w)}
    content = {m.group() for hit in hits for m in _WORD.finditer(hit.content) if not _code_word(m.group())}
    plain = [w for w in asked if not _code_word(w)]
    words = sorted(content | set(plain))
    lexemes = dict(conn.execute("SELECT w, tsvector_to_array(kb_lexemes(w)) FROM unnest(%s::text[]) AS w",
                                (words,)).fetchall()) if words else {}
    stems = {lexeme for w in plain for lexeme in lexemes.get(w, [])}
    for hit in hits:
        hit.highlights = [(m.start(), m.end()) for m in _WORD.finditer(hit.content)
                          if (_compact(m.group()) in codes if _code_word(m.group())
                              else stems & set(lexemes.get(m.group(), [])))]
