"""A first ingest timed as the process a user runs, and each stage against what its library alone does with the
same input (issue 21).

    .venv/bin/python -m bench.first_ingest ../shared/datasets/scifact/corpus.jsonl --home /tmp/kb-bench-first \
        --peer-python /work/lc-venv/bin/python

1. `kb ingest CORPUS --source bench --json` in a fresh database, as a child process, timed as a whole (Python's
   start, imports and the model's load included; the run reaches Dagster through the `kb_cli_runs` sensor, not
   this process). The embedded PostgreSQL server is started
   before the clock (a deployment has it running; `initdb` is a one-off), and the exported ONNX model is cached
   in --home, as after a user's first run (the export takes about 7 s once).
2. Then, in this process, the libraries alone on the same input, read back from the database the run built:
   - extract: reading the file and hashing each record's bytes with xxhash (what change detection must do);
   - chunk: kb's chunker alone (spaCy sentences, the model's tokenizer) on the stored elements, no database;
   - embed: the same embedder on the same texts (the live chunks' and cards' embed_text), no database;
   - publish: COPY alone of the same chunk rows into a table with no index, trigger or generated column.
   The ratio is the stage's time over the library's: what kb's plumbing (queries, transactions, postings, index
   builds) costs on top. enrich and cards have no library to compare with (regular expressions over the text).
3. With --peer-python, LangChain's indexing API on the same corpus, into a database of the same server, right
   after (bench/langchain_ingest.py, in its own environment; its model load excluded): the ratio is of this run,
   on this machine, never of a time measured elsewhere.

Writes bench/results/first_ingest.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.report import print_table, write_results


def run_ingest(corpus: Path, env: dict) -> tuple[float, dict]:
    kb = Path(sys.executable).with_name("kb")
    started = time.perf_counter()
    done = subprocess.run([str(kb), "ingest", str(corpus), "--source", "bench", "--public", "--json"], env=env,
                          capture_output=True, text=True, check=True)
    return time.perf_counter() - started, json.loads(done.stdout)


def run_langchain(python: Path, corpus: Path, server_url: str) -> dict:
    """bench/langchain_ingest.py as a child of the peer's environment, into a fresh database of kb's server."""
    import psycopg
    from sqlalchemy.engine import URL

    from pipelines.storage.database import ensure_database

    info = psycopg.conninfo.conninfo_to_dict(ensure_database(server_url, "langchain_bench"))
    url = URL.create("postgresql+psycopg", username=info.get("user", "postgres"), password=info.get("password"),
                     database=info["dbname"], query={k: info[k] for k in ("host", "port") if info.get(k)}
                     ).render_as_string(hide_password=False)
    done = subprocess.run([str(python), "-m", "bench.langchain_ingest", str(corpus), "--url", url],
                          cwd=Path(__file__).parent.parent, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--home", type=Path, default=Path("/tmp/kb-bench-first"))
    parser.add_argument("--peer-python", type=Path, help="the Python of an environment with LangChain"
                                                           " (bench/langchain_ingest.py says how to make it)")
    args = parser.parse_args()
    corpus = args.corpus.resolve()
    os.environ["KB_HOME"] = str(args.home)
    if (args.home / "pgdata").exists():
        sys.exit(f"Error: {args.home} already holds a knowledge base; give --home a fresh folder")
    args.home.mkdir(parents=True, exist_ok=True)

    from pipelines.ingest.chunker import Chunker
    from pipelines.ingest.elements import load_elements
    from pipelines.ingest.hashing import hash_bytes
    from pipelines.ingest.publish import INSERT_COLUMNS
    from pipelines.models.embedders import make_embedder
    from pipelines.settings import load_settings
    from pipelines.storage.database import connect, database_url

    settings = load_settings()
    embedder = make_embedder(settings)
    embedder.embed(["warm the model: its export is cached before the clock"])
    with connect(settings):  # the embedded server starts (and the schema is created) before the clock
        pass

    wall, summary = run_ingest(corpus, {**os.environ, "KB_HOME": str(args.home)})
    stages = summary["elapsed_s"]
    print(f"kb ingest: {wall:.1f} s wall, {summary['chunks_written']} chunks, {summary['embeddings_computed']} texts"
          f" embedded; stages {stages}", flush=True)

    with connect(settings) as conn:
        documents = [row[0] for row in conn.execute("SELECT document_id FROM documents ORDER BY document_id")]
        titles = dict(conn.execute("SELECT document_id, title FROM documents").fetchall())
        texts = [row[0] for row in conn.execute("SELECT embed_text FROM chunks WHERE valid_to IS NULL"
                                                " ORDER BY chunk_id")]
        columns = ", ".join(INSERT_COLUMNS)
        rows = conn.execute(f"SELECT {columns} FROM chunks WHERE valid_to IS NULL AND kind <> 'card'").fetchall()

        elements = load_elements(conn, documents)  # read before the clock: the chunker alone touches no database

        def chunk_alone() -> None:
            chunker = Chunker(embedder.counter)
            for doc_id in documents:
                chunker.chunk(elements[doc_id], titles[doc_id])

        def copy_alone() -> None:
            with conn.transaction():
                conn.execute(f"CREATE TEMP TABLE bench_copy AS SELECT {columns} FROM chunks WITH NO DATA")
                with conn.cursor().copy(f"COPY bench_copy ({columns}) FROM STDIN") as copy:
                    for row in rows:
                        copy.write_row(row)
                conn.execute("DROP TABLE bench_copy")

        def hash_alone() -> None:
            with corpus.open("rb") as handle:
                for line in handle:
                    hash_bytes(line)

        def embed_alone() -> None:
            for start in range(0, len(texts), 256):
                embedder.embed(texts[start:start + 256])

        alone = {"extract": timed(hash_alone), "chunk": timed(chunk_alone), "publish": timed(copy_alone),
                 "embed": timed(embed_alone)}
    what = {"extract": "read + xxhash of each record", "chunk": "the chunker alone (spaCy, tokenizer)",
            "embed": f"the embedder alone, {len(texts)} texts", "publish": f"COPY alone, {len(rows)} rows, no index"}
    table = [{"stage": name, "kb_s": round(stages.get(name, 0.0), 2),
              "alone_s": round(alone[name], 2) if name in alone else "-",
              "ratio": f"{stages[name] / alone[name]:.2f}x" if name in alone and alone[name] else "-",
              "library alone": what.get(name, "none")} for name in stages]
    print_table(table, ["stage", "kb_s", "alone_s", "ratio", "library alone"])
    print(f"\nprocess wall {wall:.1f} s; stages {sum(stages.values()):.1f} s; the rest (start, imports, model load,"
          f" Dagster record) {wall - sum(stages.values()):.1f} s", flush=True)
    results = {"corpus": str(corpus), "wall_s": round(wall, 2), "summary": summary, "stages": table}
    if args.peer_python:
        peer = run_langchain(args.peer_python, corpus, database_url(settings))
        print(f"LangChain index() + PGVectorStore, same run: {peer['index_s']} s ({peer['chunks']} chunks of"
              f" {peer['documents']} documents, {peer['embedded']} embedded in {peer['embed_s']} s); kb's process"
              f" against it: {wall / peer['index_s']:.2f}x")
        results.update(langchain=peer, vs_langchain=round(wall / peer["index_s"], 3))
    write_results("first_ingest", results)


if __name__ == "__main__":
    main()
