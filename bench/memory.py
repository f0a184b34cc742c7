"""Peak memory of `kb ingest` as the corpus grows: it must stay flat (stream in batches, never hold the corpus).

    .venv/bin/python -m bench.memory --documents 10000 --documents 100000

For each size, writes a synthetic JSONL corpus (documents of 150 Zipf-distributed words in 10 sentences) and runs `kb ingest` on it in a fresh KB_HOME-local database, as a child process whose peak
RSS the kernel reports (wait4). Embeddings come from a local OpenAI-compatible server returning 384-d vectors
(tests/fake_openai.py), so the run measures kb's own memory and finishes in minutes; the local model adds a
constant (its weights), not a per-document cost. Writes bench/results/memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fake_openai import FakeOpenAI  # noqa: E402  (tests/ is not a package)

from bench.report import write_results  # noqa: E402
from bench.synthetic import words  # noqa: E402


def write_corpus(path: Path, documents: int) -> None:
    rng = np.random.default_rng(5)
    with path.open("w") as out:
        for n in range(documents):
            sentences = [" ".join(words(rng, 15)).capitalize() + "." for _ in range(10)]
            out.write(json.dumps({"_id": f"doc-{n}", "title": f"Synthetic document {n}", "text": " ".join(sentences)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, action="append", required=True)
    parser.add_argument("--home", type=Path, default=Path("/tmp/kb-bench-memory"))
    args = parser.parse_args()
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url

    args.home.mkdir(parents=True, exist_ok=True)
    os.environ["KB_HOME"] = str(args.home)
    server = database_url(load_settings())  # the embedded server runs apart from the measured process
    rows = []
    with FakeOpenAI(dimensions=384) as fake:
        for documents in args.documents:
            corpus = args.home / f"corpus-{documents}.jsonl"
            write_corpus(corpus, documents)
            dbname = f"kb_bench_memory_{documents}"
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
                admin.execute(f"CREATE DATABASE {dbname}")
            env = {**os.environ, "DATABASE_URL": psycopg.conninfo.make_conninfo(server, dbname=dbname),
                   "KB_EMBEDDER": "openai", "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "bench",
                   "KB_OPENAI_MODEL": "fake-384"}
            started = time.perf_counter()
            child = subprocess.Popen([str(Path(sys.executable).parent / "kb"), "ingest", str(corpus), "--source",
                                      "synthetic", "--json"], env=env, stdout=subprocess.PIPE, text=True)
            output = child.stdout.read()
            _, status, usage = os.wait4(child.pid, 0)
            if status != 0:
                raise SystemExit(f"kb ingest failed with status {status}")
            counters = json.loads(output)
            rows.append({"documents": documents, "chunks": counters["chunks_inserted"],
                         "seconds": round(time.perf_counter() - started, 1),
                         "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)})
            print(rows[-1], flush=True)
    growth = rows[-1]["peak_rss_mb"] / rows[0]["peak_rss_mb"]
    print(f"peak RSS grows {growth:.2f}x from {rows[0]['documents']:,} to {rows[-1]['documents']:,} documents")
    write_results("memory", {"runs": rows, "growth": round(growth, 2)})


if __name__ == "__main__":
    main()
