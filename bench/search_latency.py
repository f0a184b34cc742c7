"""Hybrid search latency and throughput on a synthetic knowledge base of N chunks.

    .venv/bin/python -m bench.search_latency --chunks 10000 --chunks 100000

Each size gets its own database on the embedded server (KB_HOME, default /tmp/kb-bench-search), built once and
reused by later runs (--rebuild starts over). Reports load and HNSW build time, table + index size per chunk and
where those bytes go (bench/storage.py), and median/p95 latency of 200 hybrid queries (dense + BM25 + RRF, k=10,
k_overfetch=20) for each kind of caller and filter in CALLERS from one client, and for a caller with groups from 4
concurrent clients, with their queries per second. Query embedding is not included (the vectors are synthetic).
Also, per caller: the top 10's recall against exact search (no posting budget, no chunk-by-chunk shortcut), and
the dense arm's recall against brute force (no HNSW index: every readable vector compared), which is what HNSW
costs under a selective filter; and an as-of read inside the live history (a time at which every live chunk
existed), which reads live postings as well as closed ones.
Writes bench/results/search_latency_<sizes>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import numpy as np

from bench.report import write_results
from bench.storage import breakdown
from bench.synthetic import CLOSED_FROM, CODES
from pipelines.retrieval.search import Filters

QUERIES = 200
MODEL_KEY, DIMENSIONS = "bench:synthetic:384", 384  # as bench/synthetic.py builds it


class FixedVectors:
    """Stands in for the embedding model: returns pre-drawn query vectors, so only search is timed."""

    model_key, dimensions, counter = MODEL_KEY, DIMENSIONS, None

    def __init__(self, vectors: np.ndarray):
        self.vectors, self.next = vectors, 0

    def embed(self, texts):
        vector = self.vectors[self.next % len(self.vectors)]
        self.next += 1
        return vector[None, :]


def build_once(conn, size: int) -> dict:
    """Load `size` synthetic chunks and build the HNSW index, unless an earlier run did; returns build facts."""
    from bench.synthetic import build
    from pipelines.storage.vectors import ensure_index

    conn.execute("CREATE TABLE IF NOT EXISTS bench_build (facts jsonb NOT NULL)")
    if row := conn.execute("SELECT facts FROM bench_build").fetchone():
        return row[0]
    started = time.perf_counter()
    table = build(conn, size)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    ensure_index(conn, table)
    hnsw_s = time.perf_counter() - started
    conn.execute("ANALYZE")
    facts = {"chunks": size, "load_s": round(load_s, 1), "hnsw_build_s": round(hnsw_s, 1)}
    conn.execute("INSERT INTO bench_build VALUES (%s)", (facts,))
    return facts


# Who searches, with which filter (bench/synthetic.py spreads documents over public-a 40%, public-b 20%, hr 20%
# and finance 20%). The i-th query's filters; entity filters take a different code per query.
GROUP_CALLER = "caller with group hr (reads 80%)"
CALLERS = {
    "operator (every group, reads 100%)": lambda i: Filters(groups=["hr", "finance"]),
    GROUP_CALLER: lambda i: Filters(groups=["hr"]),
    "no key (public sources, 60%)": lambda i: Filters(),
    "group hr + source filter public-b (20%)": lambda i: Filters(groups=["hr"], source_id="public-b"),
    "group hr + as-of a month back (closed versions, 10%)": lambda i: Filters(
        groups=["hr"], as_of=datetime.fromisoformat(CLOSED_FROM.replace("Z", "+00:00")).replace(day=15)),
    "group hr + entity code (about 100 chunks per 1M)": lambda i: Filters(
        groups=["hr"], entities={"codes": [f"C-{(i * 7919) % CODES}"]}),
}


def latencies(url: str, settings, vectors: np.ndarray, queries: list[str], filters_for=CALLERS[GROUP_CALLER]) -> list[float]:
    """Seconds per query for one client on its own connection."""
    from pipelines.retrieval.search import search
    from pipelines.storage.database import connect

    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        embedder = FixedVectors(vectors)
        out = []
        for i, query in enumerate(queries):
            started = time.perf_counter()
            search(conn, embedder, query, 10, k_overfetch=20, lexical_weight=0.5, filters=filters_for(i))
            out.append(time.perf_counter() - started)
        return out


RECALL_QUERIES = 50


def recall_against_exact(url: str, settings, vectors: np.ndarray, queries: list[str], filters_for) -> float:
    """Share of the top-10 chunk ids that exact search (no posting budget, no chunk-by-chunk shortcut) also
    returns, over RECALL_QUERIES queries: what pruning and the filter paths cost in results."""
    import pipelines.retrieval.search as search_module
    from pipelines.storage.database import connect

    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        found = total = 0
        for i, query in enumerate(queries[:RECALL_QUERIES]):
            options = dict(k_overfetch=20, lexical_weight=0.5, filters=filters_for(i), vector=vectors[i], model_key=MODEL_KEY)
            fast = {h.chunk_id for h in search_module.search(conn, None, query, 10, **options)}
            budget, first = search_module.POSTING_BUDGET, search_module.FILTER_FIRST_MAX
            search_module.POSTING_BUDGET, search_module.FILTER_FIRST_MAX = 10**12, 0
            try:
                exact = {h.chunk_id for h in search_module.search(conn, None, query, 10, **options)}
            finally:
                search_module.POSTING_BUDGET, search_module.FILTER_FIRST_MAX = budget, first
            found, total = found + len(fast & exact), total + len(exact)
        return round(found / max(total, 1), 4)


def dense_recall_against_brute_force(url: str, settings, vectors: np.ndarray, queries: list[str],
                                     filters_for) -> float:
    """Share of the dense arm's top 10 (HNSW, iterative scans) that an exact scan of every readable vector under
    the same filter also returns: the planner is kept off every index for the exact run."""
    import pipelines.retrieval.search as search_module
    from pipelines.storage.database import connect

    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        found = total = 0
        for i, query in enumerate(queries[:RECALL_QUERIES]):
            options = dict(arm="dense", k_overfetch=20, filters=filters_for(i), vector=vectors[i], model_key=MODEL_KEY)
            approximate = {h.chunk_id for h in search_module.search(conn, None, query, 10, **options)}
            with conn.transaction():
                conn.execute("SET LOCAL enable_indexscan = off")
                conn.execute("SET LOCAL enable_bitmapscan = off")
                exact = {h.chunk_id for h in search_module.search(conn, None, query, 10, **options)}
            found, total = found + len(approximate & exact), total + len(exact)
        return round(found / max(total, 1), 4)


def summary(seconds: list[float]) -> dict:
    ms = sorted(t * 1000 for t in seconds)
    return {"median_ms": round(statistics.median(ms), 2), "p95_ms": round(ms[int(0.95 * len(ms)) - 1], 2)}


def measure(url: str, settings, size: int) -> dict:
    from bench.synthetic import unit_vectors, words
    from pipelines.storage.database import connect

    with connect(dataclasses.replace(settings, database_url=url)) as conn:
        facts = build_once(conn, size)
        table = conn.execute("SELECT vector_table FROM embedding_models WHERE model_key = %s", (MODEL_KEY,)).fetchone()[0]
        facts["storage"] = breakdown(conn, table, size)
        facts["bytes_per_chunk"] = facts["storage"]["bytes_per_chunk"]
        live_since = conn.execute("SELECT max(valid_from) FROM chunks WHERE valid_to IS NULL").fetchone()[0]
    rng = np.random.default_rng(11)
    queries = [" ".join(words(rng, 4)) for _ in range(QUERIES)]
    vectors = unit_vectors(rng, QUERIES)
    latencies(url, settings, vectors[:20], queries[:20])  # warm caches
    callers = {**CALLERS, "group hr + as-of inside the live history (every live chunk existed)":
               lambda i: Filters(groups=["hr"], as_of=live_since)}
    single = {name: {**summary(latencies(url, settings, vectors, queries, filters_for)),
                     "recall_vs_exact": recall_against_exact(url, settings, vectors, queries, filters_for),
                     "dense_recall_vs_brute_force": dense_recall_against_brute_force(url, settings, vectors, queries,
                                                                                    filters_for)}
              for name, filters_for in callers.items()}
    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        per_client = list(pool.map(lambda i: latencies(url, settings, np.roll(vectors, i, axis=0), queries[i:] + queries[:i]),
                                   range(4)))
    wall = time.perf_counter() - started
    together = [t for client in per_client for t in client]
    return {**facts, "single_client": single, "four_clients": {GROUP_CALLER: summary(together)},
            "qps_4_clients": round(len(together) / wall, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, action="append", required=True)
    parser.add_argument("--rebuild", action="store_true", help="drop and rebuild each size's database")
    parser.add_argument("--build-only", action="store_true", help="build (or keep) each size's database, measure nothing")
    args = parser.parse_args()
    os.environ.setdefault("KB_HOME", "/tmp/kb-bench-search")
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url, ensure_database

    settings = load_settings()
    results = []
    import psycopg

    server = database_url(settings)
    for size in args.chunks:
        if args.rebuild:
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS kb_bench_search_{size} WITH (FORCE)")
        url = ensure_database(server, f"kb_bench_search_{size}")
        if args.build_only:
            from pipelines.storage.database import connect

            with connect(dataclasses.replace(settings, database_url=url)) as conn:
                print(build_once(conn, size), flush=True)
            continue
        results.append(measure(url, settings, size))
        print(results[-1], flush=True)
    if results:
        write_results("search_latency_" + "_".join(str(size) for size in args.chunks), {"sizes": results})


if __name__ == "__main__":
    main()
