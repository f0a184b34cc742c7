"""One source's refresh spread over 1, 2 and 4 workers (issue 21): the local pool (KB_PARSE_WORKERS) and a dask
cluster (`kb ingest --dask`), on a parse-heavy folder of PDF, DOCX and HTML documents.

    .venv/bin/python -m bench.sharded_refresh ../shared/datasets/scifact/corpus.jsonl --per-format 80

Each document is 6 SciFact abstracts under their titles as headings (about 1,300 words; a PDF is 3-4 pages),
written by bench/parse_throughput.py's writers. Every configuration ingests the same folder into a fresh database,
as one `kb ingest --source docs --json` process timed as a whole (process start, model load, the parse workers'
start-up and the embedding of every chunk included); the parse stage's own time is the run's `elapsed_s.parse`. A
dask cluster (scheduler + N single-threaded workers, bench/dagster_runs.py) is started before the clock, as a
deployment's workers are up before a refresh; its start-up is reported beside. State lives in KB_HOME (default
/tmp/kb-bench-shards). Writes bench/results/sharded_refresh.json.
"""

from __future__ import annotations

import argparse
import json
import os
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
    elapsed, summary = kb("ingest", str(folder), "--source", "docs", "--json", *(["--dask", dask] if dask else []),
                          env=env)
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    assert not summary["errors"], summary["errors"][:3]
    return {"workers": f"{workers} dask" if dask else f"{workers} local", "refresh_s": round(elapsed, 1),
            "parse_s": summary["elapsed_s"]["parse"], "embed_s": summary["elapsed_s"]["embed"],
            "documents": summary["documents_published"], "chunks": summary["chunks_written"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--per-format", type=int, default=80)
    parser.add_argument("--workers", type=int, action="append")
    args = parser.parse_args()
    home = Path(os.environ.setdefault("KB_HOME", "/tmp/kb-bench-shards"))
    home.mkdir(parents=True, exist_ok=True)
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url

    server = database_url(load_settings())  # holds the embedded server for the whole benchmark
    counts = args.workers or [1, 2, 4]
    rows, cluster_start = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "docs"
        folder.mkdir()
        documents = write_corpus(folder, args.corpus, args.per_format)
        print(f"{documents} documents, {sum(p.stat().st_size for p in folder.iterdir()) / 1e6:.1f} MB", flush=True)
        for workers in counts:
            rows.append(refresh(server, folder, workers, None))
            print(rows[-1], flush=True)
        for workers in counts:
            started = time.perf_counter()
            with dask_cluster(workers, os.environ.copy(), home / "dask-logs" / str(workers)) as (address, _):
                cluster_start[workers] = round(time.perf_counter() - started, 1)
                rows.append(refresh(server, folder, workers, address))
            print(rows[-1], "cluster start-up", cluster_start[workers], "s", flush=True)
    for row in rows:
        kind = row["workers"].split()[1]
        one = next(r for r in rows if r["workers"] == f"1 {kind}")
        row["parse_speedup"] = round(one["parse_s"] / row["parse_s"], 2)
        row["refresh_speedup"] = round(one["refresh_s"] / row["refresh_s"], 2)
    print_table(rows, ["workers", "documents", "chunks", "parse_s", "parse_speedup", "embed_s", "refresh_s",
                       "refresh_speedup"])
    write_results("sharded_refresh", {"documents": documents, "per_format": args.per_format, "rows": rows,
                                      "dask_cluster_start_s": cluster_start, "cores": len(os.sched_getaffinity(0))})


if __name__ == "__main__":
    main()
