"""Search: dense (pgvector HNSW), lexical (BM25 in PostgreSQL) and their weighted RRF fusion, in one query.

See sql/queries/hybrid_search.sql. Filters apply inside both arms, so a selective filter still yields k results
(the dense arm uses pgvector's iterative index scans to keep going past filtered-out rows).

Access comes first: the caller's groups decide which sources it may read, and everything after that (both arms,
BM25 statistics, candidate pruning, fusion) works on those sources alone, so nothing a caller sees depends on
documents it cannot read.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from datetime import date, datetime

import numpy as np
import psycopg
from psycopg import sql

from pipelines.embedders import Embedder
from pipelines.settings import SQL_DIR
from pipelines.vector_store import vector_table

HYBRID = (SQL_DIR / "queries" / "hybrid_search.sql").read_text()
# HNSW candidate list: recall@100 of the dense arm 0.990 of exact search at 200 on SciFact's 10.5k chunks (0.964
# at 100); larger over-fetches get twice their size (bench/dense_recall.py). pgvector caps it at 1000.
EF_SEARCH = 200
MAX_SCAN_TUPLES = 100_000  # how far an iterative scan may go under a selective filter
RRF_K = 60
# Anserini's BM25 defaults (the BEIR baselines); not tuned on any split here. On SciFact train they give
# lexical nDCG@10 0.695 against 0.690 for the textbook k1 1.2, b 0.75 (bench/README.md).
BM25_K1, BM25_B = 0.9, 0.4
# Lexical pruning (sql/queries/hybrid_search.sql): the rarest query terms whose posting lists sum to at most
# POSTING_BUDGET nominate candidates (a lone common term reads only its best POSTING_BUDGET postings); the best
# RESCORE_MIN (or 10x the over-fetch) candidates are completed with the other terms. Narrowing filters turn it
# off (exact BM25), so a selective filter never runs out of candidates. On SciFact this returns exactly the
# rankings of unpruned BM25; it bounds the lexical arm's work at any corpus size (bench/README.md).
POSTING_BUDGET = 10_000
RESCORE_MIN = 200
ARMS = ("hybrid", "dense", "lexical")

# Codes and identifiers: letters and digits in one token (AVX-039, 42P07, HR-2024-047), snake_case names
# (max_wal_senders) or a quoted string. Plain numbers ("5 weeks") are not identifiers.
_IDENTIFIER = re.compile(
    r"\b(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9]+(?:[-_./][A-Za-z0-9]+)*\b|\b[a-z0-9]+(?:_[a-z0-9]+)+\b|\"[^\"]+\"")
_QUESTION = re.compile(r"^\s*(how|why|what|when|which|who|where|explain|describe|can|could|should|does|do|is|are)\b", re.I)


def lexical_weight_for(query: str) -> float:
    """The query classifier: identifier or code queries lean lexical (0.7), questions lean dense (0.3)."""
    if _IDENTIFIER.search(query):
        return 0.7
    if _QUESTION.match(query) or query.rstrip().endswith("?"):
        return 0.3
    return 0.5


@dataclass
class Filters:
    source_id: str | None = None
    doc_format: str | None = None
    date_from: date | None = None
    date_to: date | None = None
    entities: dict | None = None  # JSONB containment, e.g. {"codes": ["AVX-039"]}
    groups: list[str] = field(default_factory=list)  # the caller's groups: restricted sources need one of them
    as_of: datetime | None = None

    @property
    def narrows(self) -> bool:
        """True when the filters may exclude most of a source's chunks, which pruned BM25 could then miss.
        (Sources, and so access groups and source filters, are applied before pruning.)"""
        return any(getattr(self, name) is not None
                   for name in ("doc_format", "date_from", "date_to", "entities", "as_of"))

    def predicate(self) -> tuple[sql.Composable, dict]:
        """The chunk filter both arms apply; `visible_sources` is filled in from `visible_sources()`."""
        parts = [sql.SQL("c.valid_to IS NULL") if self.as_of is None else
                 sql.SQL("c.valid_from <= %(as_of)s AND (c.valid_to IS NULL OR c.valid_to > %(as_of)s)"),
                 sql.SQL("d.source_id = ANY(%(visible_sources)s)")]
        params: dict = {"as_of": self.as_of}
        optional = {
            "doc_format": "d.doc_format = %(doc_format)s",
            "date_from": "d.doc_date >= %(date_from)s",
            "date_to": "d.doc_date <= %(date_to)s",
            "entities": "c.entities @> %(entities)s",
        }
        for name, clause in optional.items():
            value = getattr(self, name)
            if value is not None:
                parts.append(sql.SQL(clause))
                params[name] = value
        return sql.SQL(" AND ").join(parts), params


VISIBLE = """
SELECT source_id, source_key FROM sources
WHERE removed_at IS NULL AND (allowed_groups IS NULL OR allowed_groups && %(groups)s::text[])
  AND (%(source_id)s::text IS NULL OR source_id = %(source_id)s)
ORDER BY source_key
"""


def visible_sources(conn: psycopg.Connection, groups: list[str], source_id: str | None = None) -> dict[str, int]:
    """{source_id: source_key} of the declared sources a caller in these groups may read (public sources, and
    restricted ones sharing a group with the caller), narrowed to one source when asked."""
    return dict(conn.execute(VISIBLE, {"groups": list(groups), "source_id": source_id}).fetchall())


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
    score: float
    dense_rank: int | None = None
    dense_score: float | None = None
    lexical_rank: int | None = None
    lexical_score: float | None = None

    def as_dict(self, debug: bool = False) -> dict:
        data = asdict(self)
        if not debug:
            for key in ("dense_rank", "dense_score", "lexical_rank", "lexical_score"):
                data.pop(key)
        return data


class QueryEmbeddingError(RuntimeError):
    pass


def embed_query(embedder: Embedder, query: str) -> np.ndarray:
    """The query's vector, refused (not searched with) when the model returns garbage: NaN scores rank nothing."""
    from pipelines.embedding import invalid_vectors

    vectors = embedder.embed([query])
    if problem := invalid_vectors(vectors, 1, embedder.dimensions).get(0):
        raise QueryEmbeddingError(f"cannot search: {problem} for the query ({embedder.model_key})")
    return vectors[0]


def _prepare(conn: psycopg.Connection, candidates: int) -> None:
    """The session's HNSW settings for this search, in one round trip."""
    ef_search = min(max(EF_SEARCH, 2 * candidates), 1000)
    conn.execute("SELECT set_config('hnsw.ef_search', %s, false), set_config('hnsw.iterative_scan', 'relaxed_order', false),"
                 " set_config('hnsw.max_scan_tuples', %s, false)", (str(ef_search), str(MAX_SCAN_TUPLES)))


def search(conn: psycopg.Connection, embedder: Embedder, query: str, k: int = 5, *, arm: str = "hybrid",
           lexical_weight: float | None = None, k_overfetch: int = 20, filters: Filters | None = None,
           model_key: str | None = None, vector: np.ndarray | None = None) -> list[Hit]:
    """Top-k chunks for a query. `arm` picks dense, lexical or both fused; lexical_weight None lets the
    query classifier choose. `vector` is the query's embedding when the caller already has it."""
    if arm not in ARMS:
        raise ValueError(f"arm must be one of {ARMS}")
    filters = filters or Filters()
    weight = {"dense": 0.0, "lexical": 1.0}.get(arm, lexical_weight if lexical_weight is not None else lexical_weight_for(query))
    if not 0 <= weight <= 1:
        raise ValueError("lexical_weight must be between 0 and 1")
    n = max(k_overfetch, k)
    visible = visible_sources(conn, filters.groups, filters.source_id)
    if not visible:
        return []
    if vector is None:
        vector = embed_query(embedder, query) if arm != "lexical" else np.zeros(embedder.dimensions, dtype=np.float32)
    predicate, params = filters.predicate()
    statement = sql.SQL(HYBRID).format(vectors=vector_table(conn, model_key or embedder.model_key), filters=predicate)
    _prepare(conn, n)
    rows = conn.execute(statement, {
        **params, "visible_sources": list(visible), "source_keys": list(visible.values()),
        "query": query, "vector": vector, "k": k, "rrf_k": RRF_K, "lexical_weight": weight,
        "dense_n": n if arm != "lexical" else 0, "lexical_n": n if arm != "dense" else 0,
        "bm25_k1": BM25_K1, "bm25_b": BM25_B,
        "posting_budget": None if filters.narrows else POSTING_BUDGET,
        "rescore_n": None if filters.narrows else max(RESCORE_MIN, 10 * n),
    }).fetchall()
    return [Hit(*row) for row in rows]


def dense_search(conn: psycopg.Connection, embedder: Embedder, query: str, k: int = 5,
                 as_of: datetime | None = None) -> list[Hit]:
    return search(conn, embedder, query, k, arm="dense", k_overfetch=k, filters=Filters(as_of=as_of))
