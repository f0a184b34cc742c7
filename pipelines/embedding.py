"""The embed stage: vectors for every embedded text that the current model has not seen yet.

Vectors are keyed by (model, hash of the embedded text): unchanged chunks, duplicate passages and restored
documents reuse what is stored and never reach the model.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

from pipelines import bulk
from pipelines.embedders import Embedder
from pipelines.report import StageReport
from pipelines.vector_store import ensure_vector_store

# Texts of drafts and of live chunks with no vector in this model's table, in hash order (keyset pages, so an
# interrupted run resumes where it stopped). Optionally limited to some sources and to shards of the hash space
# (first hex digit), which is how a model backfill fans out over Dagster partitions.
MISSING = """
SELECT t.text_hash, min(t.embed_text) FROM (
    SELECT c.text_hash, c.embed_text, c.document_id FROM chunk_drafts c
    WHERE c.text_hash IS NOT NULL AND c.text_hash > %(after)s
    UNION ALL
    SELECT c.text_hash, c.embed_text, c.document_id FROM chunks c WHERE c.valid_to IS NULL AND c.text_hash > %(after)s
) t
WHERE NOT EXISTS (SELECT 1 FROM {vectors} v WHERE v.text_hash = t.text_hash)
  AND (%(shards)s::text[] IS NULL OR left(t.text_hash, 1) = ANY(%(shards)s))
  AND (%(ids)s::text[] IS NULL OR t.document_id IN (SELECT document_id FROM documents WHERE source_id = ANY(%(ids)s)))
GROUP BY t.text_hash ORDER BY t.text_hash LIMIT %(limit)s
"""

REUSED = """
SELECT count(*) FROM chunk_drafts c
WHERE c.text_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {vectors} v WHERE v.text_hash = c.text_hash)
"""


def embed_pending(conn: psycopg.Connection, embedder: Embedder, source_ids: list[str] | None = None,
                  shards: list[str] | None = None, batch_size: int = 256, progress=None) -> StageReport:
    report = StageReport("embed", ("computed", "reused"))
    vectors = sql.Identifier(ensure_vector_store(conn, embedder.model_key, embedder.dimensions))
    report.counts["reused"] = conn.execute(sql.SQL(REUSED).format(vectors=vectors)).fetchone()[0]
    after = ""
    query = sql.SQL(MISSING).format(vectors=vectors)
    params = {"limit": batch_size, "shards": shards, "ids": source_ids}
    while rows := conn.execute(query, {**params, "after": after}).fetchall():
        hashes = [r[0] for r in rows]
        embedded = embedder.embed([r[1] for r in rows])
        with conn.transaction():
            bulk.stage_rows(conn, "kb_vectors", f"text_hash text, embedding vector({embedder.dimensions})",
                            ("text_hash", "embedding"), zip(hashes, embedded), types=("text", "vector"))
            conn.execute(sql.SQL("INSERT INTO {} SELECT * FROM kb_vectors ON CONFLICT (text_hash) DO NOTHING").format(vectors))
        report.counts["computed"] += len(rows)
        after = hashes[-1]
        if progress:
            progress(len(rows))
    return report.finish()
