"""Data checks on the published knowledge base, shared by the Dagster asset checks and the tests."""

import psycopg
from psycopg import sql

from pipelines.storage.vectors import active_model, vector_table

UNSEARCHABLE = """
SELECT
    count(*) FILTER (WHERE v.text_hash IS NULL) AS without_vector,
    count(*) FILTER (WHERE c.token_count > %(limit)s) AS over_token_limit
FROM chunks c JOIN documents d USING (document_id) LEFT JOIN {vectors} v ON v.text_hash = c.text_hash
WHERE c.valid_to IS NULL AND d.source_id = ANY(%(ids)s)
"""


def unsearchable_chunks(conn: psycopg.Connection, max_tokens: int, source_ids: list[str]) -> dict[str, int]:
    """Live chunks of these sources that search cannot serve: no vector in the model that serves (the active one,
    whatever model is configured or being built), or longer than the model reads."""
    serving = active_model(conn)
    if serving is None:
        live, over = conn.execute("SELECT count(*), count(*) FILTER (WHERE c.token_count > %(limit)s) FROM chunks c"
                                  " JOIN documents d USING (document_id) WHERE c.valid_to IS NULL"
                                  " AND d.source_id = ANY(%(ids)s)", {"limit": max_tokens, "ids": source_ids}).fetchone()
        return {"without_vector": live, "over_token_limit": over}
    query = sql.SQL(UNSEARCHABLE).format(vectors=vector_table(conn, serving))
    without_vector, over_limit = conn.execute(query, {"limit": max_tokens, "ids": source_ids}).fetchone()
    return {"without_vector": without_vector, "over_token_limit": over_limit}
