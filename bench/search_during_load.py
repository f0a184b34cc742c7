"""Search while a large load runs: hybrid search latency with a source filter on a synthetic store of N chunks,
before and while a new source of M chunks is loaded into the same model's table (issue 27, item 12).

    .venv/bin/python -m bench.search_during_load --chunks 100000 --load 100000
    .venv/bin/python -m bench.search_during_load --chunks 100000 --load 100000 --drop-index   # as kb did before

The store is bench/search_latency.py's database for N (built once, reused). The load goes in as a refresh writes it:
documents and chunks by COPY (the lexical triggers compute their postings), vectors through the embed stage's writer
(`store_vectors`, batches of 5,000) after `defer_index`, which now keeps a serving index. `--drop-index` drops the
index for the load and builds it after, as `defer_index` did for a load at least the size of the table. One client
searches without pause from before the load until it ends; the loaded rows are deleted afterwards, so the store can
be measured again. Writes bench/results/search_during_load_<N>_<M>[_drop_index].json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time

import numpy as np

from bench.report import write_results
from bench.search_latency import MODEL_KEY, FixedVectors, build_once, summary
from pipelines.retrieval.search import Filters

SOURCE = "incoming"
CALLER = Filters(groups=["hr"], source_id="public-b")  # a caller searching one source it reads (20% of the store)
BATCH = 5_000


def load(url: str, settings, chunks: int, drop_index: bool, done: threading.Event, timings: dict) -> None:
    """Write `chunks` chunks of a new source and their vectors as a refresh would."""
    from psycopg import sql

    from bench.synthetic import unit_vectors, words
    from pipelines.ingest.embed import store_vectors
    from pipelines.storage import bulk
    from pipelines.storage.database import connect
    from pipelines.storage.vectors import defer_index, ensure_index

    rng = np.random.default_rng(23)
    try:
        with connect(dataclasses.replace(settings, database_url=url)) as conn:
            table = conn.execute("SELECT vector_table FROM embedding_models WHERE model_key = %s",
                                 (MODEL_KEY,)).fetchone()[0]
            conn.execute("INSERT INTO sources (source_id, kind, location) VALUES (%s, 'folder', '/synthetic/in')"
                         " ON CONFLICT DO NOTHING", (SOURCE,))
            started = time.perf_counter()
            if drop_index:
                conn.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(sql.Identifier(f"{table}_hnsw")))
            else:
                timings["index_dropped"] = defer_index(conn, table, chunks)
            for start in range(0, chunks, BATCH):
                count = min(BATCH, chunks - start)
                with conn.transaction():
                    docs = range(start // 10, (start + count + 9) // 10)
                    bulk.copy_rows(conn, "documents", ("source_id", "locator", "doc_format", "size_bytes",
                                                       "content_hash"),
                                   ((SOURCE, f"in-{d}", "txt", 1000, f"in{d}") for d in docs))
                    ids = dict(conn.execute("SELECT locator, document_id FROM documents WHERE source_id = %s"
                                            " AND locator = ANY(%s)", (SOURCE, [f"in-{d}" for d in docs])).fetchall())
                    hashes = [f"in{start + i:012d}" for i in range(count)]
                    bulk.copy_rows(conn, "chunks", ("document_id", "ordinal", "kind", "text", "embed_prefix",
                                                    "text_hash", "section_path", "token_count", "chunker_version",
                                                    "enrich_version"),
                                   ((ids[f"in-{(start + i) // 10}"], (start + i) % 10, "text",
                                     " ".join(words(rng, 120)), "", h, [], 160, "synthetic", "synthetic")
                                    for i, h in enumerate(hashes)))
                store_vectors(conn, sql.Identifier(table), hashes, unit_vectors(rng, count))
            timings["load_s"] = round(time.perf_counter() - started, 1)
            started = time.perf_counter()
            ensure_index(conn, table)
            timings["index_after_s"] = round(time.perf_counter() - started, 1)
    finally:
        done.set()


def remove_load(url: str, settings) -> None:
    from psycopg import sql

    from pipelines.storage.database import connect

    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        table = conn.execute("SELECT vector_table FROM embedding_models WHERE model_key = %s", (MODEL_KEY,)).fetchone()[0]
        conn.execute(sql.SQL("DELETE FROM {} WHERE text_hash ^@ 'in'").format(sql.Identifier(table)))
        # Closed first, in one statement (the lexical statistics move once); deleting live chunks would take them
        # out one row at a time (sql/functions/lexical.sql, kb_lexical_before_delete): over 17 minutes for 20,000.
        conn.execute("UPDATE chunks SET valid_to = now() WHERE valid_to IS NULL AND document_id IN"
                     " (SELECT document_id FROM documents WHERE source_id = %s)", (SOURCE,))
        conn.execute("DELETE FROM documents WHERE source_id = %s", (SOURCE,))
        conn.execute("DELETE FROM sources WHERE source_id = %s", (SOURCE,))


def searches(url: str, settings, stop: threading.Event | None, count: int | None) -> list[float]:
    """Seconds per hybrid search (k 10, over-fetch 20) until `stop` is set, or `count` of them."""
    from bench.synthetic import unit_vectors, words
    from pipelines.retrieval.search import search
    from pipelines.storage.database import connect

    rng = np.random.default_rng(11)
    embedder = FixedVectors(unit_vectors(rng, 500))
    out = []
    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        while (stop is None or not stop.is_set()) and (count is None or len(out) < count):
            query = " ".join(words(rng, 4))
            started = time.perf_counter()
            search(conn, embedder, query, 10, k_overfetch=20, lexical_weight=0.5, filters=CALLER)
            out.append(time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, required=True, help="the store's size (bench.search_latency's database)")
    parser.add_argument("--load", type=int, required=True, help="chunks of the new source loaded meanwhile")
    parser.add_argument("--drop-index", action="store_true", help="drop the serving index for the load (kb before)")
    args = parser.parse_args()
    os.environ.setdefault("KB_HOME", "/tmp/kb-bench-search")
    from pipelines.settings import load_settings
    from pipelines.storage.database import connect, database_url, ensure_database

    settings = load_settings()
    url = ensure_database(database_url(settings), f"kb_bench_search_{args.chunks}")
    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        build_once(conn, args.chunks)
    remove_load(url, settings)  # what an interrupted earlier run left
    searches(url, settings, None, 50)  # warm caches
    before = searches(url, settings, None, 300)
    done, timings = threading.Event(), {}
    loader = threading.Thread(target=load, args=(url, settings, args.load, args.drop_index, done, timings))
    loader.start()
    during = searches(url, settings, done, None)
    loader.join()
    remove_load(url, settings)
    result = {"store_chunks": args.chunks, "load_chunks": args.load, "drop_index": args.drop_index, **timings,
              "before": {**summary(before), "queries": len(before)},
              "during_load": {**summary(during), "queries": len(during)}}
    print(result, flush=True)
    write_results(f"search_during_load_{args.chunks}_{args.load}" + ("_drop_index" if args.drop_index else ""), result)


if __name__ == "__main__":
    main()
