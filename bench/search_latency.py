"""Hybrid search latency and throughput on a synthetic knowledge base of N chunks.

    .venv/bin/python bench/search_latency.py --chunks 10000 --chunks 100000

Each size gets a fresh database on the embedded server (KB_HOME, default /tmp/kb-bench-search). Reports HNSW
build time, table + index size per chunk, median/p95 latency of 200 hybrid queries (dense + BM25 + RRF, k=10,
k_overfetch=20) from one client, and queries per second from 4 concurrent clients. Query embedding is not
included (the vectors are synthetic). Writes bench/results/search_latency.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

QUERIES = 200


class FixedVectors:
    """Stands in for the embedding model: returns pre-drawn query vectors, so only search is timed."""

    model_key, dimensions, counter = "local:all-MiniLM-L6-v2:384", 384, None

    def __init__(self, vectors: np.ndarray):
        self.vectors, self.next = vectors, 0

    def embed(self, texts):
        vector = self.vectors[self.next % len(self.vectors)]
        self.next += 1
        return vector[None, :]


def measure(url: str, settings, size: int) -> dict:
    import psycopg

    from bench.synthetic import build, unit_vectors, words
    from pipelines.database import connect
    from pipelines.search import search

    settings = dataclasses.replace(settings, database_url=url)
    with connect(settings) as conn:
        started = time.perf_counter()
        table = build(conn, size)
        load_s = time.perf_counter() - started
        started = time.perf_counter()
        conn.execute(f"CREATE INDEX vectors_local_all_minilm_l6_v2_384_hnsw ON {table} USING hnsw (embedding vector_cosine_ops)")
        hnsw_s = time.perf_counter() - started
        size_bytes = conn.execute("SELECT sum(pg_total_relation_size(c)) FROM unnest(ARRAY['chunks', 'lexical_postings', %s]::regclass[]) c",
                                  (table,)).fetchone()[0]
    rng = np.random.default_rng(11)
    queries = [" ".join(words(rng, 4)) for _ in range(QUERIES)]
    vectors = unit_vectors(rng, QUERIES)

    def one(conn, embedder, query):
        started = time.perf_counter()
        search(conn, embedder, query, 10, k_overfetch=20, lexical_weight=0.5)
        return time.perf_counter() - started

    with connect(settings) as conn:
        embedder = FixedVectors(vectors)
        for q in queries[:10]:
            one(conn, embedder, q)  # warm caches
        single = [one(conn, embedder, q) for q in queries]

    def client(index: int) -> int:
        with psycopg.connect(url, autocommit=True) as conn:
            from pgvector.psycopg import register_vector

            register_vector(conn)
            embedder = FixedVectors(np.roll(vectors, index, axis=0))
            for q in queries:
                one(conn, embedder, q)
        return len(queries)

    started = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        done = sum(pool.map(client, range(4)))
    qps = done / (time.perf_counter() - started)
    ms = sorted(t * 1000 for t in single)
    return {"chunks": size, "load_s": round(load_s, 1), "hnsw_build_s": round(hnsw_s, 1),
            "bytes_per_chunk": round(size_bytes / size), "median_ms": round(statistics.median(ms), 2),
            "p95_ms": round(ms[int(0.95 * len(ms)) - 1], 2), "qps_4_clients": round(qps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, action="append", required=True)
    args = parser.parse_args()
    os.environ.setdefault("KB_HOME", "/tmp/kb-bench-search")
    from pipelines.database import database_url, ensure_database
    from pipelines.settings import load_settings

    settings = load_settings()
    results = []
    import psycopg

    server = database_url(settings)
    for size in args.chunks:
        with psycopg.connect(server, autocommit=True) as admin:  # a fresh database per size
            admin.execute(f"DROP DATABASE IF EXISTS kb_bench_search_{size} WITH (FORCE)")
        url = ensure_database(server, f"kb_bench_search_{size}")
        results.append(measure(url, settings, size))
        print(results[-1], flush=True)
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "search_latency.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
