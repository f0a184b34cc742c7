"""Bulk upserts against a one-INSERT-per-row loop, side by side in one run, into the same table and indexes.

    .venv/bin/python -m bench.bulk_upsert --rows 50000

Every variant writes the same N (text hash, 384-d vector) rows into its own fresh table made by kb's vector
store template, on the embedded server under KB_HOME (default /tmp/kb-bench-bulk).

Write path (table with its primary key, no HNSW, so only the writing differs):
  - row loop, autocommit: one INSERT ... ON CONFLICT DO NOTHING per row, each its own transaction (what the
    seed designs and several peers do);
  - row loop, one transaction: the same statements committed once (the round trips alone);
  - kb bulk: `pipelines.ingest.embed.store_vectors`, COPY into a temp table and one merge per batch, one
    transaction per batch, at the embed stage's batch size (256) and at 10,000 rows per batch.
Searchable table (primary key + HNSW at the end, as search needs it): the row loop into the indexed table,
against what kb's embed stage does for a big load: drop the index, bulk-write, build the index once.
Finally every row is written again with kb bulk: 0 new rows, nothing rewritten (idempotent).
Writes bench/results/bulk_upsert.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from contextlib import nullcontext

import numpy as np
import psycopg
from psycopg import sql

from bench.report import print_table, write_results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=256, help="kb bulk batch (the embed stage's default)")
    parser.add_argument("--large-batch", type=int, default=10_000, help="a second kb bulk batch, for the ceiling")
    args = parser.parse_args()
    os.environ.setdefault("KB_HOME", "/tmp/kb-bench-bulk")

    from bench.synthetic import unit_vectors
    from pipelines.ingest.embed import store_vectors
    from pipelines.settings import load_settings
    from pipelines.storage.database import connect, database_url, ensure_database
    from pipelines.storage.vectors import defer_index, ensure_index, ensure_vector_store

    settings = load_settings()
    url = database_url(settings)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS kb_bench_bulk WITH (FORCE)")
    settings = dataclasses.replace(settings, database_url=ensure_database(url, "kb_bench_bulk"))
    rng = np.random.default_rng(11)
    vectors = unit_vectors(rng, args.rows)
    hashes = [f"{i:032x}" for i in rng.permutation(args.rows)]

    def row_loop(conn, table: str, one_transaction: bool = False) -> None:
        insert = sql.SQL("INSERT INTO {} (text_hash, embedding) VALUES (%s, %s) ON CONFLICT (text_hash) DO NOTHING"
                         ).format(sql.Identifier(table))
        with conn.transaction() if one_transaction else nullcontext():
            for h, v in zip(hashes, vectors):
                conn.execute(insert, (h, v))

    def kb_bulk(conn, table: str, batch: int = args.batch) -> int:
        return sum(store_vectors(conn, sql.Identifier(table), hashes[i:i + batch], vectors[i:i + batch])
                   for i in range(0, args.rows, batch))

    def kb_embed_stage(conn, table: str) -> None:
        defer_index(conn, table, args.rows)
        kb_bulk(conn, table)
        ensure_index(conn, table)

    bulk_name = f"kb bulk (COPY + merge, {args.batch}/batch)"
    variants = [  # (group, variant, with HNSW index, writer)
        ("write path", "row loop, autocommit", False, row_loop),
        ("write path", "row loop, one transaction", False, lambda conn, table: row_loop(conn, table, True)),
        ("write path", bulk_name, False, kb_bulk),
        ("write path", f"kb bulk (COPY + merge, {args.large_batch}/batch)", False,
         lambda conn, table: kb_bulk(conn, table, args.large_batch)),
        ("searchable", "row loop, autocommit, into the HNSW-indexed table", True, row_loop),
        ("searchable", f"{bulk_name}, then one HNSW build", True, kb_embed_stage),
    ]
    rows = []
    with connect(settings) as conn:
        for number, (group, name, hnsw, write) in enumerate(variants):
            table = ensure_vector_store(conn, f"bench:variant{number}:384", 384)
            if hnsw:
                ensure_index(conn, table)  # only the first model a store sees is created with its index
            else:
                conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(f"{table}_hnsw")))
            started = time.perf_counter()
            write(conn, table)
            seconds = time.perf_counter() - started
            stored = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0]
            assert stored == args.rows, f"{name} stored {stored} of {args.rows} rows"
            rows.append({"group": group, "variant": name, "seconds": round(seconds, 2),
                         "rows_per_s": round(args.rows / seconds)})
        before = conn.execute(sql.SQL("SELECT sum(xmin::text::bigint) FROM {}").format(sql.Identifier(table))).fetchone()[0]
        started = time.perf_counter()
        again = kb_bulk(conn, table)
        after = conn.execute(sql.SQL("SELECT sum(xmin::text::bigint) FROM {}").format(sql.Identifier(table))).fetchone()[0]
        rerun = {"seconds": round(time.perf_counter() - started, 2), "new_rows": again, "rows_rewritten": before != after}
    for row in rows:
        bulk = next(r for r in rows if r["group"] == row["group"] and r["variant"].startswith(bulk_name))
        row["kb_bulk_speedup"] = round(bulk["rows_per_s"] / row["rows_per_s"], 1)
    print_table(rows, ["group", "variant", "seconds", "rows_per_s", "kb_bulk_speedup"])
    print(f"kb bulk rerun of all {args.rows} rows: {rerun['seconds']} s, {rerun['new_rows']} new, "
          f"rows rewritten: {rerun['rows_rewritten']}")
    write_results("bulk_upsert", {"rows": args.rows, "dimensions": 384, "variants": rows, "idempotent_rerun": rerun})


if __name__ == "__main__":
    main()
