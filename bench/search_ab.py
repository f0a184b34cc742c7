"""Hybrid search latency of two bench databases side by side, in alternating rounds, so that both pay the same load.

    .venv/bin/python -m bench.search_ab --chunks 100000 --rounds 3 /tmp/kb-before-home /tmp/kb-after-home
    .venv/bin/python -m bench.search_ab --chunks 100000 /tmp/kb-before-home=/tmp/kb-before-code /tmp/kb-after-home

Each KB_HOME holds a database that bench/search_latency.py built for that size, possibly with older code: it is
read as it is, never migrated (a plain connection, not kb's), with this checkout's search statement, which is
what a layout change that keeps the statement (sql/013's) should be compared with. A layout the statement changed
with (sql/014's) is searched by the code that wrote it: HOME=TREE runs that database's rounds in a child process
importing kb from TREE (a checkout of the older commit). Each round runs bench.search_latency's 200 queries of the
caller with group hr (or --caller) on one database, then the other; prints the median and p95 of each round.
--same-lexical instead compares the lexical arm's top 10s of every caller between the two databases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
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


def _connect(url: str) -> psycopg.Connection:
    from psycopg.types.json import JsonbDumper

    conn = psycopg.connect(url, autocommit=True)
    register_vector(conn)
    conn.adapters.register_dumper(dict, JsonbDumper)  # entity filters
    return conn


def one_round(url: str, queries: list[str], vectors: np.ndarray, caller: str = GROUP_CALLER) -> dict:
    from pipelines.retrieval.search import search

    with _connect(url) as conn:
        seconds = []
        for i, query in enumerate(queries):
            started = time.perf_counter()
            search(conn, None, query, 10, k_overfetch=20, lexical_weight=0.5, filters=CALLERS[caller](i),
                   vector=vectors[i], model_key=MODEL_KEY)
            seconds.append(time.perf_counter() - started)
    return summary(seconds)


def lexical_top10(url: str, queries: list[str], vectors: np.ndarray, caller: str = GROUP_CALLER) -> list[list[int]]:
    """The lexical arm's top 10 chunk ids of each query: two layouts of the same synthetic build (bench.synthetic is
    seeded, so chunk ids match) should return the same chunks, whatever HNSW graph each built."""
    from pipelines.retrieval.search import search

    with _connect(url) as conn:
        return [[h.chunk_id for h in search(conn, None, query, 10, arm="lexical", k_overfetch=20,
                                            filters=CALLERS[caller](i), vector=vectors[i], model_key=MODEL_KEY)]
                for i, query in enumerate(queries)]


def _queries(count: int = QUERIES) -> tuple[list[str], np.ndarray]:
    rng = np.random.default_rng(11)  # bench.search_latency's queries
    queries = [" ".join(words(rng, 4)) for _ in range(QUERIES)]
    return queries[:count], unit_vectors(rng, QUERIES)[:count]


def _round_with(tree: str | None, url: str, count: int, caller: str, lexical: bool = False):
    """A round (or the lexical top 10s) in this process, or in a child that imports kb (and these queries) from an
    older checkout."""
    if tree is None:
        return (lexical_top10 if lexical else one_round)(url, *_queries(count), caller)
    child = subprocess.run([sys.executable, __file__, "--round", url, "--count", str(count), "--caller", caller]
                           + ["--same-lexical"] * lexical, cwd=tree,
                           env={**os.environ, "PYTHONPATH": tree}, capture_output=True, text=True, check=True)
    return json.loads(child.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--chunks", type=int, help="the size bench.search_latency built")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--caller", default=GROUP_CALLER, choices=list(CALLERS), help="bench.search_latency's callers")
    parser.add_argument("--same-lexical", action="store_true",
                        help="compare the lexical arm's top 10s of every caller instead of timing")
    parser.add_argument("--round", help=argparse.SUPPRESS)  # a child's one round against this URL
    parser.add_argument("--count", type=int, default=QUERIES, help=argparse.SUPPRESS)
    parser.add_argument("homes", nargs="*", help="two KB_HOME folders, each optionally =TREE")
    args = parser.parse_args()
    if args.round:
        measure = lexical_top10 if args.same_lexical else one_round
        print(json.dumps(measure(args.round, *_queries(args.count), args.caller)))
        return
    if args.chunks is None or len(args.homes) != 2:
        parser.error("give --chunks and two KB_HOME folders")
    homes = [(home, tree or None) for home, _, tree in (h.partition("=") for h in args.homes)]
    urls = {home: psycopg.conninfo.make_conninfo(_server(home), dbname=f"kb_bench_search_{args.chunks}")
            for home, _ in homes}
    if args.same_lexical:
        for caller in CALLERS:
            (a, tree_a), (b, tree_b) = homes
            first = _round_with(tree_a, urls[a], QUERIES, caller, lexical=True)
            second = _round_with(tree_b, urls[b], QUERIES, caller, lexical=True)
            same = sum(x == y for x, y in zip(first, second))
            shared = sum(len(set(x) & set(y)) for x, y in zip(first, second))
            print(f"{caller}: identical top 10s {same}/{len(first)}, chunks in both {shared}/{sum(map(len, first))}")
        return
    for home, tree in homes:
        _round_with(tree, urls[home], 20, args.caller)  # warm caches
    for round_ in range(args.rounds):
        for home, tree in homes:
            print(f"round {round_ + 1} {home}: {_round_with(tree, urls[home], QUERIES, args.caller)}", flush=True)


if __name__ == "__main__":
    main()
