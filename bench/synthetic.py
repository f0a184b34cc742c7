"""A synthetic knowledge base for scale benchmarks: Zipf-distributed words, random unit vectors.

Rows go in through the same tables, triggers and indexes as real ingests (COPY, like the publish stage), so search
and index costs are real; only the text and the vectors are made up.
"""

from __future__ import annotations

import numpy as np
import psycopg
from pgvector import HalfVector

from pipelines.storage import bulk
from pipelines.storage.vectors import defer_index, ensure_vector_store

MODEL_KEY, DIMENSIONS = "bench:synthetic:384", 384
VOCABULARY = 30_000


def words(rng: np.random.Generator, count: int) -> list[str]:
    ranks = np.minimum(rng.zipf(1.3, count), VOCABULARY)
    return [f"w{r}" for r in ranks]


def unit_vectors(rng: np.random.Generator, count: int) -> np.ndarray:
    vectors = rng.normal(size=(count, DIMENSIONS)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


# Documents are spread over four sources, two of them restricted to a group, so that search can be measured
# for callers who read different shares of the corpus (10 documents in a row: 4, 2, 2 and 2 of each).
SOURCES = (("public-a", None), ("public-a", None), ("public-a", None), ("public-a", None), ("public-b", None),
           ("public-b", None), ("hr", ["hr"]), ("hr", ["hr"]), ("finance", ["finance"]), ("finance", ["finance"]))
CODES = 10_007  # each chunk carries one entity code, C-<document mod CODES>: about 100 chunks per code at 1M
HISTORY_EVERY = 10  # every 10th document also has a closed older version, for as-of queries
LIVE_SINCE = "2026-01-01T00:00:00Z"  # live chunks' valid_from; closed versions lived in the month before
CLOSED_FROM, CLOSED_TO = "2025-12-01T00:00:00Z", LIVE_SINCE


def build(conn: psycopg.Connection, chunks: int, seed: int = 7, batch: int = 20_000) -> str:
    """Insert `chunks` live chunks (10 per document) and their vectors, plus a closed older version of every
    HISTORY_EVERY-th document, without the HNSW index (the caller builds it once, as kb's embed stage does after
    a big load); returns the vector table."""
    from psycopg.types.json import Jsonb

    rng = np.random.default_rng(seed)
    table = ensure_vector_store(conn, MODEL_KEY, DIMENSIONS)
    defer_index(conn, table, chunks)
    for source_id, groups in dict(SOURCES).items():
        conn.execute("INSERT INTO sources (source_id, kind, location, allowed_groups) VALUES (%s, 'folder', %s, %s)"
                     " ON CONFLICT DO NOTHING", (source_id, f"/synthetic/{source_id}", groups))
    columns = ("document_id", "ordinal", "kind", "text", "embed_prefix", "text_hash", "section_path", "token_count",
               "chunker_version", "enrich_version", "entities", "valid_from", "valid_to")
    for start in range(0, chunks, batch):
        count = min(batch, chunks - start)
        with conn.transaction():
            docs = range(start // 10, (start + count + 9) // 10)
            bulk.copy_rows(conn, "documents", ("source_id", "locator", "doc_format", "size_bytes", "content_hash"),
                           ((SOURCES[d % 10][0], f"doc-{d}", "txt", 1000, f"h{d}") for d in docs))
            ids = dict(conn.execute("SELECT locator, document_id FROM documents WHERE locator = ANY(%s)",
                                    ([f"doc-{d}" for d in docs],)).fetchall())
            live = [(start + i, " ".join(words(rng, 120)), f"s{start + i:012d}") for i in range(count)]
            closed = [(n, " ".join(words(rng, 120)), f"o{n:012d}") for n, _, _ in live if (n // 10) % HISTORY_EVERY == 0]
            rows = [(ids[f"doc-{n // 10}"], n % 10, "text", t, "", h, [], 160, "synthetic", "synthetic",
                     Jsonb({"codes": [f"C-{(n // 10) % CODES}"]}), valid_from, valid_to)
                    for rows_, valid_from, valid_to in ((live, LIVE_SINCE, None), (closed, CLOSED_FROM, CLOSED_TO))
                    for n, t, h in rows_]
            bulk.copy_rows(conn, "chunks", columns, rows)
            hashes = [h for _, _, h in live + closed]
            bulk.copy_rows(conn, table, ("text_hash", "embedding"),
                           zip(hashes, map(HalfVector, unit_vectors(rng, len(hashes)))), types=("text", "halfvec"))
    conn.execute("ANALYZE")
    return table
