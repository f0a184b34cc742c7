"""The planner's statistics brought up to date after a large publish, not a minute later.

PostgreSQL plans every query from the statistics ANALYZE gathers; autovacuum refreshes them when it next looks, up to
a minute after a table changed by a tenth. A first ingest fills chunks, postings and terms from empty (the migrations
analyzed them empty) and searches them at once: the calibrate stage's probes, the golden-set gate, the first users.
On statistics that say "empty" those searches are planned badly: the calibrate stage of a 2,500-record SciFact
ingest took 38.9 s, and 25.3 s once the tables were analyzed (bench/README.md). So a publish that wrote more than
STALE_SHARE of the chunks the planner believes the table holds analyzes what it wrote, as autovacuum would later.
"""

from __future__ import annotations

import psycopg
from psycopg import sql

# The tables a publish fills, with the chunks: their sizes grow together.
PUBLISHED_TABLES = ("documents", "chunks", "lexical_postings", "lexical_terms")
STALE_SHARE = 0.1  # autovacuum's own default (autovacuum_analyze_scale_factor)
# How long a table another session holds is waited for: longer than deadlock_timeout (1 s by default), after which
# PostgreSQL cancels an autovacuum that blocks us; an operator's VACUUM or an index build is not cancelled.
LOCK_WAIT = "5s"
BELIEVED = "SELECT reltuples FROM pg_class WHERE oid = 'chunks'::regclass"


def analyze_if_stale(conn: psycopg.Connection, chunks_written: int, tables: tuple[str, ...] = ()) -> list[str]:
    """ANALYZE the published tables (and `tables`, the vector tables the run wrote) when `chunks_written` is more than
    STALE_SHARE of the chunks the planner believes there are (-1: never analyzed), each in its own transaction so
    that its lock is held for its sample only. A table another session holds (an operator's VACUUM, an index build)
    is left to autovacuum after LOCK_WAIT: the run never waits on maintenance. Returns the tables analyzed."""
    believed = conn.execute(BELIEVED).fetchone()[0]
    if chunks_written <= STALE_SHARE * max(believed, 0):
        return []
    analyzed = []
    for table in (*PUBLISHED_TABLES, *tables):
        try:
            with conn.transaction():
                conn.execute("SELECT set_config('lock_timeout', %s, true)", (LOCK_WAIT,))  # SET LOCAL
                conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(table)))
        except psycopg.errors.LockNotAvailable:
            continue
        analyzed.append(table)
    return analyzed
