"""Staleness sweeps: flag documents whose source has not been crawled within its freshness window (the source's
declared freshness_hours, else the default window)."""

from __future__ import annotations

from datetime import timedelta

import psycopg
from psycopg.rows import dict_row

from pipelines.settings import Settings

FLAG = """
UPDATE documents d SET stale_since = now()
FROM sources s
WHERE d.source_id = s.source_id AND d.deleted_at IS NULL AND d.stale_since IS NULL
  AND (s.last_crawled_at IS NULL
       OR s.last_crawled_at < now() - coalesce(make_interval(secs => s.freshness_hours * 3600), %(window)s))
"""
UNFLAG = """
UPDATE documents d SET stale_since = NULL
FROM sources s
WHERE d.source_id = s.source_id AND d.stale_since IS NOT NULL
  AND (d.deleted_at IS NOT NULL
       OR s.last_crawled_at >= now() - coalesce(make_interval(secs => s.freshness_hours * 3600), %(window)s))
"""

PER_SOURCE = """
SELECT s.source_id, s.last_crawled_at, count(d.*) FILTER (WHERE d.stale_since IS NOT NULL) AS stale_documents,
       min(d.stale_since) AS stale_since
FROM sources s LEFT JOIN documents d ON d.source_id = s.source_id AND d.deleted_at IS NULL
WHERE s.removed_at IS NULL
GROUP BY s.source_id, s.last_crawled_at ORDER BY s.source_id
"""


def sweep(conn: psycopg.Connection, freshness: timedelta) -> dict:
    """Flag (and un-flag) stale documents; `freshness` is the window of sources that declare none. Returns the
    count, the oldest crawl and a per-source breakdown."""
    with conn.transaction():
        flagged = conn.execute(FLAG, {"window": freshness}).rowcount
        cleared = conn.execute(UNFLAG, {"window": freshness}).rowcount
    with conn.cursor(row_factory=dict_row) as cur:
        per_source = cur.execute(PER_SOURCE).fetchall()
    stale = [s for s in per_source if s["stale_documents"]]
    return {
        "stale_documents": sum(s["stale_documents"] for s in per_source),
        "newly_flagged": flagged,
        "cleared": cleared,
        "oldest_crawl": min((s["last_crawled_at"] for s in stale if s["last_crawled_at"]), default=None),
        "sources": per_source,
    }


def sweep_sources(conn: psycopg.Connection, settings: Settings, freshness_hours: float | None = None) -> dict:
    """The sweep, then the purge of history older than KB_RETENTION_DAYS when it is set: what `kb sweep` and the
    `stale_documents` asset both run. It holds every source's lock, so no refresh is half-way through."""
    from pipelines.sources.declarations import load_sources
    from pipelines.storage.history import purge_history
    from pipelines.storage.locks import source_locks

    window = timedelta(hours=freshness_hours if freshness_hours is not None else settings.freshness_hours)
    with source_locks(conn, [s.source_id for s in load_sources(conn)]):
        result = sweep(conn, window)
        if settings.retention_days is not None:
            result["retention"] = purge_history(conn, settings.retention_days)
    return result
