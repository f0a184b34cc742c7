"""Where a knowledge base's bytes go: each table's heap, TOAST and indexes, and the widest columns of `chunks`.

    KB_HOME=/tmp/kb-bench-search .venv/bin/python -m bench.storage --chunks 10000
    KB_HOME=/tmp/kb-eval .venv/bin/python -m bench.storage --database kb_eval_scifact --migrate

reads the database bench/search_latency.py built for that size, or any kb database, and prints bytes per live
chunk for each relation; bench.search_latency records the same breakdown. It migrates nothing (an old build can be
read by new code) unless --migrate: then it applies this checkout's pending migrations in place, timed, and
prints the breakdown before and after.
"""

from __future__ import annotations

import argparse
import os
import time

import psycopg
from psycopg import sql

# The tables a chunk costs bytes in, and the stored columns of `chunks` worth seeing one by one.
# lexical_postings_closed holds what lexical_postings held with live = false before sql/014.
TABLES = ("chunks", "lexical_postings", "lexical_postings_closed")
CHUNK_COLUMNS = ("text", "embed_text", "embed_prefix", "search_tsv", "entities", "section_path", "text_hash")

RELATIONS = """
SELECT t.relname, 'heap', pg_relation_size(t.oid) + pg_relation_size(t.oid, 'fsm') + pg_relation_size(t.oid, 'vm')
FROM pg_class t WHERE t.oid = ANY(%(tables)s::regclass[])
UNION ALL
SELECT t.relname, 'toast', coalesce(pg_total_relation_size(nullif(t.reltoastrelid, 0)), 0)
FROM pg_class t WHERE t.oid = ANY(%(tables)s::regclass[])
UNION ALL
SELECT t.relname, 'index ' || i.relname, pg_relation_size(i.oid)
FROM pg_class t JOIN pg_index x ON x.indrelid = t.oid JOIN pg_class i ON i.oid = x.indexrelid
WHERE t.oid = ANY(%(tables)s::regclass[])
ORDER BY 1, 2
"""


def breakdown(conn: psycopg.Connection, vector_table: str, chunks: int) -> dict:
    """{"relations": [[table, part, bytes per chunk]], "chunk_columns": {column: average stored bytes per row},
    "rows": {table: rows}, "bytes_per_chunk": total}: per live chunk, history included in the numerator."""
    tables = [*TABLES, vector_table]
    tables = [t for t in tables if conn.execute("SELECT to_regclass(%s)", (t,)).fetchone()[0]]  # any schema version
    rows = conn.execute(RELATIONS, {"tables": tables}).fetchall()
    present = {name for (name,) in conn.execute(  # stored columns only: a virtual one costs no bytes
        "SELECT attname FROM pg_attribute WHERE attrelid = 'chunks'::regclass AND attnum > 0 AND NOT attisdropped"
        " AND attgenerated <> 'v'")}
    columns = [c for c in CHUNK_COLUMNS if c in present]
    averages = conn.execute(sql.SQL("SELECT {} FROM chunks").format(sql.SQL(", ").join(
        sql.SQL("coalesce(avg(pg_column_size({})), 0)").format(sql.Identifier(c)) for c in columns))).fetchone()
    counts = {t: conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(t))).fetchone()[0]
              for t in tables}
    return {"relations": [[table, part, round(size / chunks)] for table, part, size in rows],
            "chunk_columns": {c: round(float(a)) for c, a in zip(columns, averages)},
            "rows": counts,
            "bytes_per_chunk": round(sum(size for _, _, size in rows) / chunks)}


def _print(facts: dict) -> None:
    for table, part, size in facts["relations"]:
        print(f"{table:24} {part:48} {size:>7,}")
    print("chunks columns (average bytes per row):", facts["chunk_columns"])
    print("rows:", facts["rows"], " bytes per live chunk:", f"{facts['bytes_per_chunk']:,}")


def main() -> None:
    parser = argparse.ArgumentParser()
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--chunks", type=int, help="the size bench.search_latency built")
    which.add_argument("--database", help="any kb database on KB_HOME's server")
    parser.add_argument("--migrate", action="store_true", help="apply pending migrations in place, timed")
    args = parser.parse_args()
    os.environ.setdefault("KB_HOME", "/tmp/kb-bench-search")
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url
    from pipelines.storage.migrations import migrate

    server = database_url(load_settings())
    url = psycopg.conninfo.make_conninfo(server, dbname=args.database or f"kb_bench_search_{args.chunks}")
    with psycopg.connect(url, autocommit=True) as conn:
        table = conn.execute("SELECT vector_table FROM embedding_models WHERE state = 'active'").fetchone()[0]
        live = conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NULL").fetchone()[0]
        _print(breakdown(conn, table, live))
        if args.migrate:
            started = time.perf_counter()
            applied = migrate(conn)
            print(f"\nmigrated in {time.perf_counter() - started:.1f} s: {', '.join(applied) or 'nothing pending'}\n")
            _print(breakdown(conn, table, live))


if __name__ == "__main__":
    main()
