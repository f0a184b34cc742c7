"""A bucket as a source (issue 28): first ingest, a no-op refresh and 1% of the objects changed, on an S3 API served
over HTTP on loopback (moto's server), with the requests each refresh made.

    .venv/bin/python -m bench.bucket_refresh ../shared/datasets/scifact/corpus.jsonl --objects 10000 --home /tmp/kb-bench-bucket
    .venv/bin/python -m bench.bucket_refresh ... --peer langchain   # the same steps with LangChain's S3 loader + index()

`--peer langchain` needs `pip install langchain-community==0.4.2 langchain-core==1.8.3 langchain-classic==1.0.8
greenlet` (not in kb's lock): S3DirectoryLoader (each object downloaded and parsed by unstructured) into index()
with a SQLRecordManager (SQLite) and an InMemoryVectorStore, embedding with kb's own local model, cleanup="full".

Each object is one SciFact abstract as Markdown (`# title` then the text); past the corpus' end records repeat with a
line naming the copy, so every object's text is distinct. Each step is one `ingest` of the source in this process
(the model is loaded before the clock), timed whole. Requests are read from the server's log: LIST (a listing page),
GET (an object's bytes), other. Writes bench/results/bucket_refresh_<N>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.report import print_table, write_results


def _serve(log: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=log.open("wb"))
    url = f"http://127.0.0.1:{port}"
    import httpx

    for _ in range(600):
        try:
            httpx.get(url, timeout=5)
            return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    raise SystemExit(f"moto_server did not start: {log.read_text()[-2000:]}")


def _requests(log: Path, bucket: str) -> list[str]:
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text())
    return [line.split('"')[1] for line in text.splitlines() if line.count('"') >= 2 and f"/{bucket}" in line]


def _kinds(lines: list[str], bucket: str) -> dict:
    kinds = Counter("LIST" if line.startswith(f"GET /{bucket}?") else "GET" if line.startswith(f"GET /{bucket}/")
                    else line.split()[0] for line in lines)
    return dict(sorted(kinds.items()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--peer", choices=["langchain"], help="run the steps through a peer instead of kb")
    args = parser.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    args.home.mkdir(parents=True)
    os.environ["KB_HOME"] = str(args.home)
    log = args.home / "s3-requests.log"
    server, url = _serve(log)
    os.environ.update(AWS_ENDPOINT_URL=url, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")
    try:
        run(args, log)
    finally:
        server.terminate()
        server.wait(timeout=30)


def run(args, log: Path) -> None:
    import boto3

    from pipelines.models.embedders import make_embedder
    from pipelines.settings import load_settings

    records = [json.loads(line) for line in args.corpus.read_text().splitlines() if line.strip()]
    texts = {}
    for i in range(args.objects):
        record = records[i % len(records)]
        copy = f"\n\n(copy {i // len(records)})" if i >= len(records) else ""
        texts[f"docs/{i:05d}.md"] = f"# {record.get('title') or record['_id']}\n\n{record['text']}{copy}\n"
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    client = boto3.client("s3")
    client.create_bucket(Bucket=bucket)

    def upload(items) -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda kv: client.put_object(Bucket=bucket, Key=kv[0], Body=kv[1].encode()), items))

    upload(texts.items())
    settings = load_settings()
    embedder = make_embedder(settings)
    embedder.embed(["warm up"])
    refresh = _langchain(args, bucket, embedder) if args.peer else _kb(settings, bucket, embedder)
    results = []

    def step(name: str) -> None:
        before = len(_requests(log, bucket))
        started = time.perf_counter()
        counts = refresh()
        seconds = time.perf_counter() - started
        made = _requests(log, bucket)[before:]
        results.append({"step": name, "seconds": round(seconds, 2), "requests": len(made),
                        "by_kind": _kinds(made, bucket), **counts})

    step("first ingest")
    step("no-op refresh")
    changed = sorted(texts)[:: 100]  # 1%
    upload((key, texts[key] + "\nEdited for the benchmark.\n") for key in changed)
    step("1% changed")
    print_table([{**r, "by_kind": " ".join(f"{k} {v}" for k, v in r["by_kind"].items())} for r in results],
                ["step", "seconds", "requests", "by_kind", "new", "changed", "unchanged", "embedded"])
    path = write_results(f"bucket_refresh_{args.objects}" + (f"_{args.peer}" if args.peer else ""),
                         {"objects": args.objects, "corpus": str(args.corpus), "peer": args.peer,
                          "load_average": os.getloadavg(), "steps": results})
    print(f"wrote {path}")


def _kb(settings, bucket: str, embedder):
    """One kb refresh of the bucket's source per call, as `kb ingest --source bucket` runs it."""
    from pipelines.ingest.run import ingest
    from pipelines.sources.declarations import add_source, declare
    from pipelines.storage.database import connect

    with connect(settings, install=True) as conn:
        add_source(conn, declare("bucket", f"s3://{bucket}/docs", groups=None), "bench/bucket_refresh.py")

    def refresh() -> dict:
        with connect(settings) as conn:
            counters = ingest(conn, embedder, settings, ["bucket"]).counters()
        return {"new": counters["documents_new"], "changed": counters["documents_changed"],
                "unchanged": counters["documents_unchanged"], "embedded": counters["embeddings_computed"],
                "stages_s": {k: round(v, 2) for k, v in counters["elapsed_s"].items()}}

    return refresh


def _langchain(args, bucket: str, embedder):
    """One LangChain incremental index() of the bucket per call: its documented way to avoid re-embedding."""
    from langchain_classic.indexes import SQLRecordManager, index
    from langchain_community.document_loaders import S3DirectoryLoader
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import InMemoryVectorStore

    class LocalModel(Embeddings):
        def __init__(self) -> None:
            self.texts = 0

        def embed_documents(self, texts: list[str]) -> list[list[float]]:
            self.texts += len(texts)
            return [list(map(float, v)) for v in embedder.embed(texts)]

        def embed_query(self, text: str) -> list[float]:
            return self.embed_documents([text])[0]

    from pipelines.ingest.parse import offline_spacy

    offline_spacy()  # unstructured would download its sentence model; kb's offline copy serves both
    model = LocalModel()
    records = SQLRecordManager("bench", db_url=f"sqlite:///{args.home / 'langchain-records.sqlite'}")
    records.create_schema()
    store = InMemoryVectorStore(model)
    loader = S3DirectoryLoader(bucket, prefix="docs/", endpoint_url=os.environ["AWS_ENDPOINT_URL"])

    def refresh() -> dict:
        before = model.texts
        result = index(loader, records, store, cleanup="full", source_id_key="source")
        return {"new": result["num_added"], "changed": result["num_updated"], "unchanged": result["num_skipped"],
                "embedded": model.texts - before, "deleted": result["num_deleted"]}

    return refresh


if __name__ == "__main__":
    main()
