"""A synthetic knowledge base for scale benchmarks: Zipf-distributed words, random unit vectors.

Rows go in through the same tables, triggers and indexes as real ingests (COPY, like the publish stage), so search
and index costs are real; only the text and the vectors are made up.
"""

from __future__ import annotations

import numpy as np
import psycopg

from pipelines import bulk
from pipelines.vector_store import defer_index, ensure_vector_store

MODEL_KEY, DIMENSIONS = "bench:synthetic:384", 384
VOCABULARY = 30_000


def words(rng: np.random.Generator, count: int) -> list[str]:
    ranks = np.minimum(rng.zipf(1.3, count), VOCABULARY)
    return [f"w{r}" for r in ranks]


def unit_vectors(rng: np.random.Generator, count: int) -> np.ndarray:
    vectors = rng.normal(size=(count, DIMENSIONS)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def build(conn: psycopg.Connection, chunks: int, seed: int = 7, batch: int = 20_000) -> str:
    """Insert `chunks` live chunks (10 per document) and their vectors, without the HNSW index (the caller builds
    it once, as kb's embed stage does after a big load); returns the vector table."""
    rng = np.random.default_rng(seed)
    table = ensure_vector_store(conn, MODEL_KEY, DIMENSIONS)
    defer_index(conn, table, chunks)
    conn.execute("INSERT INTO sources (source_id, kind, location) VALUES ('synthetic', 'folder', '/synthetic')"
                 " ON CONFLICT DO NOTHING")
    for start in range(0, chunks, batch):
        count = min(batch, chunks - start)
        with conn.transaction():
            docs = range(start // 10, (start + count + 9) // 10)
            bulk.copy_rows(conn, "documents", ("source_id", "locator", "doc_format", "size_bytes", "content_hash"),
                           (("synthetic", f"doc-{d}", "txt", 1000, f"h{d}") for d in docs))
            ids = dict(conn.execute("SELECT locator, document_id FROM documents WHERE locator = ANY(%s)",
                                    ([f"doc-{d}" for d in docs],)).fetchall())
            texts = [" ".join(words(rng, 120)) for _ in range(count)]
            hashes = [f"s{start + i:012d}" for i in range(count)]
            bulk.copy_rows(conn, "chunks", ("document_id", "ordinal", "kind", "text", "embed_text", "text_hash",
                                            "section_path", "token_count", "chunker_version", "enrich_version"),
                           ((ids[f"doc-{(start + i) // 10}"], (start + i) % 10, "text", t, t, h, [], 160, "synthetic",
                             "synthetic") for i, (t, h) in enumerate(zip(texts, hashes))))
            bulk.copy_rows(conn, table, ("text_hash", "embedding"), zip(hashes, unit_vectors(rng, count)),
                           types=("text", "vector"))
    conn.execute("ANALYZE")
    return table
