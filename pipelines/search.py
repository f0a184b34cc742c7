"""Dense search over the live chunks: pgvector HNSW (cosine) on the current model's vectors."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import datetime

import psycopg
from psycopg import sql

from pipelines.embedders import Embedder
from pipelines.vector_store import vector_table

EF_SEARCH = 100

# Live chunks by default; with an as-of time, the chunks that were live then (history is never rewritten).
DENSE = """
SELECT c.chunk_id, d.source_id, d.locator, d.title, c.section_path, c.text, c.entities,
       1 - (v.embedding <=> %(q)s) AS score
FROM {vectors} v
JOIN chunks c ON c.text_hash = v.text_hash
JOIN documents d ON d.document_id = c.document_id
WHERE CASE WHEN %(as_of)s::timestamptz IS NULL THEN c.valid_to IS NULL
           ELSE c.valid_from <= %(as_of)s AND (c.valid_to IS NULL OR c.valid_to > %(as_of)s) END
ORDER BY v.embedding <=> %(q)s
LIMIT %(k)s
"""


@dataclass
class Hit:
    chunk_id: int
    source: str
    document: str
    title: str | None
    section_path: list[str]
    content: str
    entities: dict
    score: float

    def as_dict(self) -> dict:
        return asdict(self)


def dense_search(conn: psycopg.Connection, embedder: Embedder, query: str, k: int = 5,
                 as_of: datetime | None = None) -> list[Hit]:
    vector = embedder.embed([query])[0]
    with conn.transaction():
        # Iterative scans keep going past ef_search when joined rows (closed chunks) are filtered out.
        conn.execute(sql.SQL("SET LOCAL hnsw.ef_search = {}").format(sql.Literal(EF_SEARCH)))
        conn.execute("SET LOCAL hnsw.iterative_scan = strict_order")
        rows = conn.execute(sql.SQL(DENSE).format(vectors=vector_table(conn, embedder.model_key)),
                            {"q": vector, "k": k, "as_of": as_of}).fetchall()
    return [Hit(*row) for row in rows]
