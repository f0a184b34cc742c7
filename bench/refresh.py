"""Incremental refresh costs on a JSONL corpus: full ingest, no-op rerun, 1% edited, 1% deleted.

    .venv/bin/python bench/refresh.py ../shared/datasets/scifact/corpus.jsonl --home /tmp/kb-bench

Prints a table and writes bench/results/refresh.json. Pass --skip-full to reuse a KB_HOME that already holds a
full ingest of the corpus under source `bench` (its time is then not re-measured).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path


class CountingEmbedder:
    def __init__(self, inner):
        self.inner, self.texts, self.calls = inner, 0, 0
        self.model_key, self.dimensions, self.counter = inner.model_key, inner.dimensions, inner.counter

    def embed(self, texts):
        self.texts += len(texts)
        self.calls += 1
        return self.inner.embed(texts)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--home", type=Path, required=True)
    parser.add_argument("--skip-full", action="store_true")
    args = parser.parse_args()
    os.environ["KB_HOME"] = str(args.home)

    from pipelines.ingest.run import ingest
    from pipelines.models.embedders import make_embedder
    from pipelines.settings import load_settings
    from pipelines.sources.declarations import add_source, declare
    from pipelines.storage.database import connect

    settings = load_settings()
    work = args.home / "bench-corpus.jsonl"
    args.home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(args.corpus, work)
    records = [json.loads(line) for line in work.read_text().splitlines() if line.strip()]
    embedder = make_embedder(settings)
    results = []

    def step(name: str, rows: list[dict]) -> None:
        work.write_text("".join(json.dumps(r) + "\n" for r in rows))
        counting = CountingEmbedder(embedder)
        started = time.perf_counter()
        with connect(settings) as conn:
            add_source(conn, declare("bench", work), "bench/refresh.py")
            counters = ingest(conn, counting, settings, ["bench"]).counters()
        results.append({"step": name, "seconds": round(time.perf_counter() - started, 2),
                        "texts_embedded": counting.texts, "model_calls": counting.calls,
                        **{k: counters[k] for k in ("documents_changed", "documents_deleted", "chunks_inserted",
                                                    "chunks_closed", "chunks_written", "embeddings_computed")}})
        print(results[-1], flush=True)

    if not args.skip_full:
        step("full ingest", records)
    step("no-op rerun", records)
    edited = [dict(r, text=r["text"] + " This abstract was revised.") if i % 100 == 0 else r
              for i, r in enumerate(records)]
    step("1% edited", edited)
    remaining = [r for i, r in enumerate(edited) if i % 100 != 50]
    step("1% deleted", remaining)
    step("restored", edited)

    full = next((r["seconds"] for r in results if r["step"] == "full ingest"), None)
    print(f"\n{'step':<14}{'seconds':>9}{'ratio':>8}{'embedded':>10}{'chunks in':>10}{'closed':>8}")
    for r in results:
        ratio = f"{r['seconds'] / full:.2%}" if full else "-"
        print(f"{r['step']:<14}{r['seconds']:>9}{ratio:>8}{r['texts_embedded']:>10}{r['chunks_inserted']:>10}{r['chunks_closed']:>8}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "refresh.json").write_text(json.dumps({"corpus": str(args.corpus), "steps": results}, indent=2))


if __name__ == "__main__":
    main()
