"""What `kb status` shows: per-source counts, current failures, models and the last run."""

from __future__ import annotations

import psycopg
from psycopg.rows import dict_row

from pipelines.sources.declarations import ON_DISK

SOURCES = """
SELECT s.source_id, s.kind, s.location, s.allowed_groups, s.declared_in, s.last_crawled_at, s.last_crawl,
       (SELECT count(*) FROM documents d WHERE d.source_id = s.source_id AND d.deleted_at IS NULL) AS documents,
       (SELECT count(*) FROM documents d WHERE d.source_id = s.source_id AND d.deleted_at IS NOT NULL) AS deleted,
       (SELECT count(*) FROM chunks c JOIN documents d USING (document_id)
         WHERE d.source_id = s.source_id AND c.valid_to IS NULL) AS chunks,
       (SELECT count(*) FROM failures f WHERE f.source_id = s.source_id) AS failed,
       (SELECT count(*) FROM documents d WHERE d.source_id = s.source_id AND d.stale_since IS NOT NULL
          AND d.deleted_at IS NULL) AS stale
FROM sources s WHERE s.removed_at IS NULL ORDER BY s.source_id
"""


def crawl_line(crawl: dict) -> str:
    """A crawl of one source in words (extract's summary, pipelines/ingest/extract.py): `10000 listed, 100 fetched,
    9900 unchanged (9900 not read: ETag), 0 failed, 0 deleted`. Local files are read, remote ones fetched."""
    if crawl.get("blind"):
        return "saw nothing: the source could not be read (see failing), and nothing was deleted"
    read = "read" if crawl["kind"] in ON_DISK else "fetched"
    unread = f" ({crawl['unread']} not read: {crawl['unread_by']})" if crawl["unread"] else ""
    return (f"{crawl['listed']} listed, {crawl['read']} {read}, {crawl['unchanged']} unchanged{unread},"
            f" {crawl['failed']} failed, {crawl['deleted']} deleted")


def knowledge_base_status(conn: psycopg.Connection) -> dict:
    with conn.cursor(row_factory=dict_row) as cur:
        return {
            "sources": cur.execute(SOURCES).fetchall(),
            "failures": cur.execute("SELECT source_id, locator, stage, reason, recorded_at FROM failures"
                                    " ORDER BY source_id, locator").fetchall(),
            "models": cur.execute("SELECT model_key, dimensions, state FROM embedding_models ORDER BY created_at").fetchall(),
            "answer_calibrations": cur.execute(
                "SELECT model_key, CASE scope_group WHEN '' THEN 'public' ELSE scope_group END AS scope, fitted_at,"
                " chunks, answer_at, report FROM answer_calibrations ORDER BY model_key, scope_group").fetchall(),
            "last_run": cur.execute("SELECT run_id, started_by, external_run_id, started_at, finished_at, sources,"
                                    " counters FROM ingest_runs"
                                    " ORDER BY run_id DESC LIMIT 1").fetchone(),
        }


def ingest_statistics(conn: psycopg.Connection, source_ids: list[str] | None = None) -> dict:
    """What the knowledge base holds, for plots: chunk lengths (model tokens), documents per format, failures."""
    params = {"ids": source_ids}
    scope = "(%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))"
    return {
        "chunk_tokens": [r[0] for r in conn.execute(
            f"SELECT c.token_count FROM chunks c JOIN documents d USING (document_id)"
            f" WHERE c.valid_to IS NULL AND c.kind <> 'card' AND {scope}", params)],
        "documents_per_format": dict(conn.execute(
            f"SELECT d.doc_format, count(*) FROM documents d WHERE d.deleted_at IS NULL AND {scope}"
            " GROUP BY 1 ORDER BY 2 DESC", params).fetchall()),
        "failures_per_stage": dict(conn.execute(
            "SELECT f.stage, count(*) FROM failures f WHERE (%(ids)s::text[] IS NULL OR f.source_id = ANY(%(ids)s))"
            " GROUP BY 1 ORDER BY 2 DESC", params).fetchall()),
    }
