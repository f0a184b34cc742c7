"""Where each embedding model's vectors live: one table per model (sql/templates/vector_store.sql).

A table per model keeps each vector column typed to its dimension (HNSW needs that) and lets a new model's
vectors and index be built beside the serving ones.
"""

from __future__ import annotations

import re

import psycopg
from psycopg import sql

from pipelines.settings import SQL_DIR

TEMPLATE = SQL_DIR / "templates" / "vector_store.sql"
INDEX_TEMPLATE = SQL_DIR / "templates" / "vector_index.sql"
DEFER_INDEX_MIN_ROWS = 2_000  # loads smaller than this go through the live index


MAX_NAME = 63  # PostgreSQL cuts identifiers longer than this


def table_name(model_key: str) -> str:
    """A readable table name per model; one too long to keep whole is cut and ends in a hash of the whole key,
    so two long keys that share a prefix never share a table."""
    from pipelines.ingest.hashing import hash_text

    name = "vectors_" + re.sub(r"[^a-z0-9]+", "_", model_key.lower()).strip("_")
    if len(name) <= MAX_NAME - 5:  # room for the index's "_hnsw"
        return name
    return f"{name[:MAX_NAME - 5 - 17]}_{hash_text(model_key)[:16]}"


def ensure_vector_store(conn: psycopg.Connection, model_key: str, dimensions: int) -> str:
    """Register the model with this dimension and create its vector table and HNSW index if needed; returns the
    table name. A model registers as the serving one only when no model serves yet; otherwise it is built beside
    it and serves only when an operator switches (`activate_if_complete`). A registered model whose table is gone
    (dropped by hand, or by kb before issue 18 when it retired a model) gets an empty one again."""
    row = _registered(conn, model_key, dimensions)
    if row is not None and _exists(conn, row):
        return row
    table = row or table_name(model_key)
    with conn.transaction():
        # Backfill shards start together, on one machine or many: one creates the table, the others wait and find it
        # (concurrent CREATE TABLE IF NOT EXISTS can fail on the catalog's unique indexes).
        conn.execute("SELECT pg_advisory_xact_lock(hashtext('kb.ensure_vector_store'))")
        row = _registered(conn, model_key, dimensions)
        if row is not None and _exists(conn, row):
            return row
        conn.execute(sql.SQL(TEMPLATE.read_text()).format(table=sql.Identifier(table),
                                                          dimensions=sql.Literal(int(dimensions))))
        active = active_model(conn)
        if active is None or active == model_key:
            ensure_index(conn, table)  # it serves from its first vector; a model being built gets its index at activation
        conn.execute(
            "INSERT INTO embedding_models (model_key, dimensions, vector_table, state, activated_at)"
            " VALUES (%s, %s, %s, %s, CASE WHEN %s THEN now() END) ON CONFLICT (model_key) DO NOTHING",
            (model_key, dimensions, table, "building" if active else "active", not active),
        )
    return table


def registered_dimensions(conn: psycopg.Connection, model_key: str) -> int | None:
    """The dimension a model was registered with: fixed for good, whatever its embedder answers later."""
    row = conn.execute("SELECT dimensions FROM embedding_models WHERE model_key = %s", (model_key,)).fetchone()
    return row[0] if row else None


def _exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (sql.Identifier(table).as_string(conn),)).fetchone()[0]


def _registered(conn: psycopg.Connection, model_key: str, dimensions: int) -> str | None:
    row = conn.execute("SELECT vector_table, dimensions FROM embedding_models WHERE model_key = %s", (model_key,)).fetchone()
    if row is not None and row[1] != dimensions:
        raise ValueError(f"model {model_key} is registered with {row[1]} dimensions, not {dimensions}")
    return row[0] if row else None


def ensure_index(conn: psycopg.Connection, table: str) -> None:
    """Build the table's HNSW index if it is missing (after a deferred load, or one a crash interrupted)."""
    conn.execute(sql.SQL(INDEX_TEMPLATE.read_text()).format(table=sql.Identifier(table),
                                                            index=sql.Identifier(f"{table}_hnsw")))


def defer_index(conn: psycopg.Connection, table: str, incoming: int) -> bool:
    """Drop the HNSW index of a serving table that holds no vector yet before a large first load, so it is built
    once afterwards instead of grown row by row (`ensure_index` builds it). Only then: an index that serves any
    vector is kept whatever the load, since every search of every source reads it, and a load must never turn them
    into exact scans (a large source added to a serving store grows the index row by row; bench/README.md, "Search
    during a load"). Returns True when it dropped the index. (A model being built has no index at all until
    `activate_if_complete`.)"""
    if incoming < DEFER_INDEX_MIN_ROWS:
        return False
    if conn.execute(sql.SQL("SELECT EXISTS (SELECT 1 FROM {})").format(sql.Identifier(table))).fetchone()[0]:
        return False
    conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(f"{table}_hnsw")))
    return True


def vector_table(conn: psycopg.Connection, model_key: str) -> sql.Identifier:
    row = conn.execute("SELECT vector_table FROM embedding_models WHERE model_key = %s", (model_key,)).fetchone()
    if row is None:
        raise LookupError(f"no vectors stored for model {model_key}; run `kb ingest` with it first")
    return sql.Identifier(row[0])


def model_tables(conn: psycopg.Connection, states: tuple[str, ...] = ("active", "building")) -> dict[str, str]:
    """model_key -> vector table, for the models in the given states."""
    rows = conn.execute("SELECT model_key, vector_table FROM embedding_models WHERE state = ANY(%s) ORDER BY created_at",
                        (list(states),)).fetchall()
    return dict(rows)


def active_model(conn: psycopg.Connection) -> str | None:
    row = conn.execute("SELECT model_key FROM embedding_models WHERE state = 'active'").fetchone()
    return row[0] if row else None


MISSING_LIVE = "SELECT count(*) FROM chunks c WHERE c.valid_to IS NULL AND NOT EXISTS (SELECT 1 FROM {} v WHERE v.text_hash = c.text_hash)"


def _switch_readiness(conn: psycopg.Connection, model_key: str, lock: bool = False) -> tuple[str, str | None]:
    """("active" | "incomplete" | "ready" | "unknown", vector table) for a model; `lock` holds its row until
    commit. A model with no vectors stored yet (a run that stopped before embedding) is "unknown"."""
    row = conn.execute("SELECT state, vector_table FROM embedding_models WHERE model_key = %s"
                       + (" FOR UPDATE" if lock else ""), (model_key,)).fetchone()
    if row is None:
        return "unknown", None
    state, table = row
    if state == "active":
        return state, table
    missing = conn.execute(sql.SQL(MISSING_LIVE).format(sql.Identifier(table))).fetchone()[0]
    return ("incomplete" if missing else "ready"), table


def activate_if_complete(conn: psycopg.Connection, model_key: str) -> bool:
    """Switch search to a model being built once every live chunk has its vector, in one transaction; the previous
    model is retired, its table and index kept (switching back needs no re-embedding; docs/architecture.md says how
    an operator drops one). Returns True when the model is (now) the active one.

    Only an operator's switch calls this (the `active_model` asset, `kb dagster reembed`), never an ingest: what a
    run happens to embed must not change which model serves. The new table's HNSW index is built here, once,
    over the complete backfill and before it serves (outside the switch's transaction, which re-checks readiness
    under a row lock)."""
    readiness, table = _switch_readiness(conn, model_key)
    if readiness != "ready":
        return readiness == "active"
    ensure_index(conn, table)
    with conn.transaction():
        readiness, _ = _switch_readiness(conn, model_key, lock=True)
        if readiness != "ready":
            return readiness == "active"
        conn.execute("UPDATE embedding_models SET state = 'retired' WHERE state = 'active'")
        conn.execute("UPDATE embedding_models SET state = 'active', activated_at = now() WHERE model_key = %s", (model_key,))
    return True
