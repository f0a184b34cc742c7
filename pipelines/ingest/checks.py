"""Data checks on the published knowledge base, shared by Dagster asset checks and the tests."""

import psycopg
from psycopg import sql

from pipelines.models.embedders import Embedder
from pipelines.storage.vectors import vector_table

UNSEARCHABLE = """
SELECT
    count(*) FILTER (WHERE v.text_hash IS NULL) AS without_vector,
    count(*) FILTER (WHERE c.token_count > %(limit)s) AS over_token_limit
FROM chunks c LEFT JOIN {vectors} v ON v.text_hash = c.text_hash
WHERE c.valid_to IS NULL
"""


def unsearchable_chunks(conn: psycopg.Connection, embedder: Embedder) -> dict[str, int]:
    query = sql.SQL(UNSEARCHABLE).format(vectors=vector_table(conn, embedder.model_key))
    without_vector, over_limit = conn.execute(query, {"limit": embedder.counter.max_tokens}).fetchone()
    return {"without_vector": without_vector, "over_token_limit": over_limit}
