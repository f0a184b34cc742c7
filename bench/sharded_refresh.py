"""One source's refresh spread over 1, 2 and 4 workers (issue 21): the local pool (KB_PARSE_WORKERS) and a dask
cluster (`kb ingest --dask`), on a parse-heavy folder of PDF, DOCX and HTML documents.

    .venv/bin/python -m bench.sharded_refresh ../shared/datasets/scifact/corpus.jsonl --per-format 60 --rounds 2

Each document is 6 SciFact abstracts under their titles as headings (about 1,300 words; a PDF is 3-4 pages),
written by bench/parse_throughput.py's writers. Every configuration ingests the same folder into a fresh database,
as one `kb ingest --source docs --json` process timed as a whole (process start, model load, the parse workers'
start-up and the embedding of every chunk included); the parse stage's own time is the run's `elapsed_s.parse`. A
dask cluster (scheduler + N single-threaded workers, bench/dagster_runs.py) is started before the clock, as a
deployment's workers are up before a refresh; its start-up is reported beside. The configurations take turns
round by round (a shared machine's load then falls on all of them alike); the table has each one's median, and
the speed-ups are against one worker of the same kind. State lives in KB_HOME (default /tmp/kb-bench-shards).
Writes bench/results/sharded_refresh.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from bench.dagster_runs import dask_cluster, kb
from bench.parse_throughput import SECTIONS, write_docx, write_html, write_pdf
from bench.report import print_table, write_results

WRITERS = {"pdf": write_pdf, "docx": write_docx, "html": write_html}


def write_corpus(folder: Path, corpus: Path, per_format: int) -> int:
    lines = corpus.read_text().splitlines()[:per_format * SECTIONS]
    records = [json.loads(line) for line in lines]
    for n in range(per_format):
        sections = [(r["title"], r["text"]) for r in records[n * SECTIONS:(n + 1) * SECTIONS]]
        for fmt, write in WRITERS.items():
            write(folder / f"doc-{n:04d}.{fmt}", f"Collected abstracts {n}", sections)
    return per_format * len(WRITERS)


def refresh(server: str, folder: Path, workers: int, dask: str | None) -> dict:
    """`kb ingest` of the folder into a fresh database, with `workers` local processes or over the dask cluster."""
    import psycopg

    from pipelines.storage.database import ensure_database

    name = f"kb_bench_shards_{'dask' if dask else 'local'}_{workers}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    env = {**os.environ, "DATABASE_URL": ensure_database(server, name), "KB_PARSE_WORKERS": str(workers)}
    elapsed, summary = kb("ingest", str(folder), "--source", "docs", "--public", "--json", *(["--dask", dask] if dask else []),
                          env=env)
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    assert not summary["errors"], summary["errors"][:3]
    return {"workers": f"{workers} dask" if dask else f"{workers} local", "refresh_s": round(elapsed, 1),
            "parse_s": summary["elapsed_s"]["parse"], "chunk_s": summary["elapsed_s"]["chunk"],
            "embed_s": summary["elapsed_s"]["embed"],
            "documents": summary["documents_published"], "chunks": summary["chunks_written"]}


def configuration(server: str, folder: Path, home: Path, workers: int, dask: bool) -> dict:
    if not dask:
        return refresh(server, folder, workers, None)
    started = time.perf_counter()
    with dask_cluster(workers, os.environ.copy(), home / "dask-logs" / str(workers)) as (address, _):
        cluster_start = round(time.perf_counter() - started, 1)
        return {**refresh(server, folder, workers, address), "cluster_start_s": cluster_start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--per-format", type=int, default=60)
    parser.add_argument("--workers", type=int, action="append")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    home = Path(os.environ.setdefault("KB_HOME", "/tmp/kb-bench-shards"))
    home.mkdir(parents=True, exist_ok=True)
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url

    server = database_url(load_settings())  # holds the embedded server for the whole benchmark
    configurations = [(n, dask) for dask in (False, True) for n in args.workers or [1, 2, 4]]
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "docs"
        folder.mkdir()
        documents = write_corpus(folder, args.corpus, args.per_format)
        print(f"{documents} documents, {sum(p.stat().st_size for p in folder.iterdir()) / 1e6:.1f} MB", flush=True)
        for round_ in range(args.rounds):
            for workers, dask in configurations:
                runs.append({"round": round_, **configuration(server, folder, home, workers, dask)})
                print(runs[-1], flush=True)
    rows = []
    for name in dict.fromkeys(run["workers"] for run in runs):
        mine = [run for run in runs if run["workers"] == name]
        rows.append({"workers": name, "documents": mine[0]["documents"], "chunks": mine[0]["chunks"],
                     **{key: round(statistics.median(run[key] for run in mine), 1)
                        for key in ("parse_s", "chunk_s", "embed_s", "refresh_s")}})
    for row in rows:
        one = next(r for r in rows if r["workers"] == f"1 {row['workers'].split()[1]}")
        row["parse_speedup"] = round(one["parse_s"] / row["parse_s"], 2)
        row["chunk_speedup"] = round(one["chunk_s"] / row["chunk_s"], 2)
        row["refresh_speedup"] = round(one["refresh_s"] / row["refresh_s"], 2)
    print_table(rows, ["workers", "documents", "chunks", "parse_s", "parse_speedup", "chunk_s", "chunk_speedup",
                       "embed_s", "refresh_s", "refresh_speedup"])
    write_results("sharded_refresh", {"documents": documents, "per_format": args.per_format, "rows": rows,
                                      "runs": runs, "cores": len(os.sched_getaffinity(0))})


if __name__ == "__main__":
    main()
