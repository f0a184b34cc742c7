"""Hybrid search latency of two bench databases side by side, in alternating rounds, so that both pay the same load.

    .venv/bin/python -m bench.search_ab --chunks 100000 --rounds 3 /tmp/kb-before-home /tmp/kb-after-home

Each KB_HOME holds a database that bench/search_latency.py built for that size, possibly with older code: it is
read as it is, never migrated (a plain connection, not kb's), with this checkout's search statement, which is
what a layout change (sql/013's) should be compared with. Each round runs bench.search_latency's 200 queries of
the caller with group hr on one database, then the other; prints the median and p95 of each round.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import psycopg
from pgvector.psycopg import register_vector

from bench.search_latency import CALLERS, GROUP_CALLER, MODEL_KEY, QUERIES, summary
from bench.synthetic import unit_vectors, words


def _server(home: str) -> str:
    import dataclasses
    from pathlib import Path

    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url

    return database_url(dataclasses.replace(load_settings(), home=Path(home), database_url=None))


def one_round(url: str, queries: list[str], vectors: np.ndarray) -> dict:
    from pipelines.retrieval.search import search

    with psycopg.connect(url, autocommit=True) as conn:
        register_vector(conn)
        seconds = []
        for i, query in enumerate(queries):
            started = time.perf_counter()
            search(conn, None, query, 10, k_overfetch=20, lexical_weight=0.5, filters=CALLERS[GROUP_CALLER](i),
                   vector=vectors[i], model_key=MODEL_KEY)
            seconds.append(time.perf_counter() - started)
    return summary(seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, required=True, help="the size bench.search_latency built")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("homes", nargs=2, help="two KB_HOME folders")
    args = parser.parse_args()
    rng = np.random.default_rng(11)  # bench.search_latency's queries
    queries = [" ".join(words(rng, 4)) for _ in range(QUERIES)]
    vectors = unit_vectors(rng, QUERIES)
    urls = {home: psycopg.conninfo.make_conninfo(_server(home), dbname=f"kb_bench_search_{args.chunks}")
            for home in args.homes}
    for home, url in urls.items():
        one_round(url, queries[:20], vectors[:20])  # warm caches
    for round_ in range(args.rounds):
        for home, url in urls.items():
            print(f"round {round_ + 1} {home}: {one_round(url, queries, vectors)}", flush=True)


if __name__ == "__main__":
    main()
