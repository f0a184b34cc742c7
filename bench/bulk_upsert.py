"""Bulk upserts against a one-INSERT-per-row loop, side by side in one run, into the same kind of table.

    .venv/bin/python -m bench.bulk_upsert --rows 50000

Each variant writes the same N (text hash, 384-d vector) rows into its own fresh vector table created by kb's
own template (primary key + HNSW index), on the embedded server under KB_HOME (default /tmp/kb-bench-bulk):
  - row loop, autocommit: one INSERT ... ON CONFLICT DO NOTHING per row, each its own transaction (what the
    seed designs and several peers do);
  - row loop, one transaction: the same statements, committed once (the round trips alone);
  - kb bulk: `pipelines.embedding.store_vectors`, COPY into a temp table and one merge per batch, one
    transaction per batch, in the embed stage's batch size.
Then it rewrites every row with kb bulk to show the upsert is idempotent (0 new rows, table unchanged).
Writes bench/results/bulk_upsert.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import numpy as np
import psycopg
from psycopg import sql

from bench.report import print_table, write_results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=256, help="kb bulk batch (the embed stage's default)")
    args = parser.parse_args()
    os.environ.setdefault("KB_HOME", "/tmp/kb-bench-bulk")

    from bench.synthetic import unit_vectors
    from pipelines.database import connect, database_url, ensure_database
    from pipelines.embedding import store_vectors
    from pipelines.settings import load_settings
    from pipelines.vector_store import ensure_vector_store

    settings = load_settings()
    url = database_url(settings)
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("DROP DATABASE IF EXISTS kb_bench_bulk WITH (FORCE)")
    settings = dataclasses.replace(settings, database_url=ensure_database(url, "kb_bench_bulk"))
    rng = np.random.default_rng(11)
    vectors = unit_vectors(rng, args.rows)
    hashes = [f"{i:032x}" for i in rng.permutation(args.rows)]

    def row_loop(conn, table, one_transaction: bool) -> None:
        insert = sql.SQL("INSERT INTO {} (text_hash, embedding) VALUES (%s, %s) ON CONFLICT (text_hash) DO NOTHING"
                         ).format(table)
        if one_transaction:
            with conn.transaction():
                for h, v in zip(hashes, vectors):
                    conn.execute(insert, (h, v))
        else:
            for h, v in zip(hashes, vectors):
                conn.execute(insert, (h, v))

    def kb_bulk(conn, table) -> int:
        return sum(store_vectors(conn, table, hashes[i:i + args.batch], vectors[i:i + args.batch])
                   for i in range(0, args.rows, args.batch))

    variants = {
        "row loop, autocommit": lambda conn, table: row_loop(conn, table, one_transaction=False),
        "row loop, one transaction": lambda conn, table: row_loop(conn, table, one_transaction=True),
        f"kb bulk (COPY + merge, {args.batch}/batch)": kb_bulk,
    }
    rows = []
    with connect(settings) as conn:
        for number, (name, write) in enumerate(variants.items()):
            table = sql.Identifier(ensure_vector_store(conn, f"bench:variant{number}:384", 384))
            started = time.perf_counter()
            write(conn, table)
            seconds = time.perf_counter() - started
            stored = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]
            assert stored == args.rows, f"{name} stored {stored} of {args.rows} rows"
            rows.append({"variant": name, "seconds": round(seconds, 2), "rows_per_s": round(args.rows / seconds)})
        started = time.perf_counter()
        again = kb_bulk(conn, table)
        rerun = {"seconds": round(time.perf_counter() - started, 2), "new_rows": again,
                 "stored": conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()[0]}
    bulk_rate = rows[-1]["rows_per_s"]
    for row in rows:
        row["kb_bulk_speedup"] = round(bulk_rate / row["rows_per_s"], 1)
    print_table(rows, ["variant", "seconds", "rows_per_s", "kb_bulk_speedup"])
    print(f"kb bulk rerun of all {args.rows} rows: {rerun['seconds']} s, {rerun['new_rows']} new, {rerun['stored']} stored")
    write_results("bulk_upsert", {"rows": args.rows, "dimensions": 384, "index": "primary key + hnsw (cosine)",
                                  "variants": rows, "idempotent_rerun": rerun})

if __name__ == "__main__":
    main()
