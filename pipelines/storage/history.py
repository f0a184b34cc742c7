"""Version history: what `kb history` shows, and the retention purge of old closed versions."""

from __future__ import annotations

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

# pages: where the version's added and closed chunks start (a publish writes its version and its chunks in one
# transaction, so both carry its now()); empty for formats without pages and for purged history.
HISTORY = """
SELECT v.version, v.event, v.recorded_at, v.content_hash, v.chunks_added, v.chunks_closed, v.chunks_kept,
       ARRAY(SELECT DISTINCT c.page_number FROM chunks c
             WHERE c.document_id = v.document_id AND c.page_number IS NOT NULL
               AND (c.valid_from = v.recorded_at OR c.valid_to = v.recorded_at) ORDER BY 1) AS pages
FROM document_versions v JOIN documents d USING (document_id)
WHERE d.locator = %(locator)s AND (%(source)s::text IS NULL OR d.source_id = %(source)s)
ORDER BY d.source_id, v.version
"""


def document_history(conn: psycopg.Connection, locator: str, source_id: str | None = None) -> list[dict]:
    """Versions of a document given as `locator` or `source:locator`."""
    if source_id is None and ":" in locator:
        candidate, _, rest = locator.partition(":")
        if conn.execute("SELECT 1 FROM sources WHERE source_id = %s", (candidate,)).fetchone():
            source_id, locator = candidate, rest
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(HISTORY, {"locator": locator, "source": source_id}).fetchall()


PURGE = """
WITH purged AS (
    DELETE FROM chunks WHERE valid_to < now() - make_interval(days => %(days)s) RETURNING 1
)
SELECT count(*) FROM purged
"""


# A vector is kept while a chunk (live or in history) or a draft not yet published uses its text.
UNUSED_VECTORS = """
DELETE FROM {table} v
WHERE NOT EXISTS (SELECT 1 FROM chunks c WHERE c.text_hash = v.text_hash)
  AND NOT EXISTS (SELECT 1 FROM chunk_drafts d WHERE d.text_hash = v.text_hash)
"""


def purge_history(conn: psycopg.Connection, older_than_days: int) -> dict[str, int]:
    """Delete chunks closed more than N days ago, then vectors that neither a chunk nor a draft uses (per model
    table). Callers hold the sources' locks (pipelines/sources/staleness.sweep_sources), so no refresh is between
    embedding its drafts and publishing them."""
    with conn.transaction():
        chunks = conn.execute(PURGE, {"days": older_than_days}).fetchone()[0]
        vectors = 0
        # Retired models' tables are kept (until an operator drops them) and purged alike; before issue 18 kb dropped
        # them, so a registered model may have no table.
        for (table,) in conn.execute("SELECT vector_table FROM embedding_models"
                                     " WHERE to_regclass(format('%I', vector_table)) IS NOT NULL").fetchall():
            vectors += conn.execute(sql.SQL(UNUSED_VECTORS).format(table=sql.Identifier(table))).rowcount
    return {"chunks_purged": chunks, "vectors_purged": vectors}
