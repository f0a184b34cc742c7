"""Peak memory of `kb ingest` as the corpus grows: it must stay flat (stream in batches, never hold the corpus).

    .venv/bin/python -m bench.memory --documents 10000 --documents 100000
    .venv/bin/python -m bench.memory --real ../shared/datasets/scifact/corpus.jsonl --documents 1000 --documents 4000

For each size, runs `kb ingest` in a fresh database as a child process and samples the resident memory of its
whole process tree (`kb ingest` and its parse workers, psutil, every 0.2 s): the peak of the sum, of the parent
alone and of the largest worker. Two corpora:
- default: a synthetic JSONL corpus (150 Zipf-distributed words in 10 sentences per document), embedded by a local
  OpenAI-compatible server returning 384-d vectors (tests/fake_openai.py): kb's own memory, in minutes;
- --real CORPUS: what a user meets: a folder of HTML, DOCX, PDF and Markdown files (a cycle of the four formats,
  each holding 3 records of the BEIR corpus under headings) parsed by `unstructured` in kb's workers and embedded by
  the default local model, whose one-off ONNX export is cached in --home first (as after a user's first run).
Writes bench/results/memory.json (memory_real.json with --real).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
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


def write_folder(folder: Path, records: list[dict], documents: int) -> None:
    """`documents` files cycling through the four formats, each 3 records under their titles as headings."""
    from bench.parse_throughput import WRITERS

    folder.mkdir(parents=True, exist_ok=True)
    formats = list(WRITERS)
    for n in range(documents):
        group = [records[(3 * n + k) % len(records)] for k in range(3)]
        fmt = formats[n % len(formats)]
        sections = [(r["title"], r["text"]) for r in group]
        WRITERS[fmt](folder / f"doc-{n:06d}.{fmt}", f"Collected abstracts {n}", sections)


def measure(command: list[str], env: dict) -> dict:
    """Run the command; the peaks of its process tree's resident memory (MB), sampled every 0.2 s, and its output."""
    import psutil

    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
    peaks = {"tree": 0.0, "parent": 0.0, "largest_worker": 0.0}
    done = threading.Event()

    def sample() -> None:
        process = psutil.Process(child.pid)
        while not done.wait(0.2):
            try:
                parent = process.memory_info().rss
                workers = [c.memory_info().rss for c in process.children(recursive=True)]
            except psutil.Error:
                continue
            peaks["tree"] = max(peaks["tree"], (parent + sum(workers)) / 1e6)
            peaks["parent"] = max(peaks["parent"], parent / 1e6)
            peaks["largest_worker"] = max(peaks["largest_worker"], max(workers, default=0) / 1e6)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    output = child.stdout.read()
    if child.wait() != 0:
        raise SystemExit(f"kb ingest failed with status {child.returncode}")
    done.set()
    sampler.join()
    return {"seconds": round(time.perf_counter() - started, 1), "output": output,
            **{f"peak_{k}_mb": round(v, 1) for k, v in peaks.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, action="append", required=True)
    parser.add_argument("--real", type=Path, help="a BEIR corpus.jsonl whose records fill real files")
    parser.add_argument("--home", type=Path, default=Path("/tmp/kb-bench-memory"))
    args = parser.parse_args()
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url

    args.home.mkdir(parents=True, exist_ok=True)
    os.environ["KB_HOME"] = str(args.home)
    server = database_url(load_settings())  # the embedded server runs apart from the measured process
    if args.real:  # the model's one-off ONNX export (torch loaded, about 1 GB) is cached before any size runs
        from pipelines.models.embedders import make_embedder

        make_embedder(load_settings()).embed(["warm the model: its export is cached before the first size"])
    kb = str(Path(sys.executable).parent / "kb")
    records = [json.loads(line) for line in args.real.read_text().splitlines()] if args.real else []
    rows = []
    with FakeOpenAI(dimensions=384) as fake:
        for documents in args.documents:
            dbname = f"kb_bench_memory_{'real_' if args.real else ''}{documents}"
            with psycopg.connect(server, autocommit=True) as admin:
                admin.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
                admin.execute(f"CREATE DATABASE {dbname}")
            env = {**os.environ, "DATABASE_URL": psycopg.conninfo.make_conninfo(server, dbname=dbname)}
            if args.real:
                corpus = args.home / f"files-{documents}"
                if not corpus.exists():
                    write_folder(corpus, records, documents)
            else:
                corpus = args.home / f"corpus-{documents}.jsonl"
                write_corpus(corpus, documents)
                env.update({"KB_EMBEDDER": "openai", "OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": "bench",
                            "KB_OPENAI_MODEL": "fake-384"})
            run = measure([kb, "ingest", str(corpus), "--source", "bench", "--public", "--json"], env)
            counters = json.loads(run.pop("output"))
            rows.append({"documents": documents, "chunks": counters["chunks_inserted"],
                         "failed": counters["documents_failed"], **run})
            print(rows[-1], flush=True)
    growth = rows[-1]["peak_tree_mb"] / rows[0]["peak_tree_mb"]
    print(f"peak RSS of the process tree grows {growth:.2f}x from {rows[0]['documents']:,} to"
          f" {rows[-1]['documents']:,} documents")
    write_results("memory_real" if args.real else "memory", {"runs": rows, "growth": round(growth, 2)})


if __name__ == "__main__":
    main()
