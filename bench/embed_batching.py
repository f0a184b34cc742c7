"""What embedding each text alone costs: the int8 model as it runs now (r3: one text per call, one thread per
call, texts in parallel over the cores) against length-sorted batches of 8 on a multi-threaded session (r2,
BatchedOnnxEmbedder, kept to serve stores built with it), same graph, same texts, alternating rounds so that a
busy machine slows both alike.

    .venv/bin/python -m bench.embed_batching ../shared/datasets/scifact/corpus.jsonl --texts 500 --rounds 3

Also reports whether each recipe gives a text the same vector in any batch: the same texts forward and
reversed (bitwise equal rows, and the lowest cosine). Writes bench/results/embed_batching.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from bench.report import print_table, write_results
from pipelines.ingest.enrich import embed_text
from pipelines.models.embedders import BatchedOnnxEmbedder, OnnxEmbedder


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--texts", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    records = [json.loads(line) for line in args.corpus.read_text().splitlines()[:args.texts]]
    texts = [embed_text(r.get("title"), [], r["text"]) for r in records]

    with tempfile.TemporaryDirectory() as cache:
        recipes = {"r2: batches of 8 (before)": BatchedOnnxEmbedder(Path(cache)), "r3: each text alone (now)": OnnxEmbedder(Path(cache))}
        seconds: dict[str, list[float]] = {name: [] for name in recipes}
        same: dict[str, tuple[float, float]] = {}
        for name, embedder in recipes.items():
            forward, backward = embedder.embed(texts[:64]), embedder.embed(texts[:64][::-1])[::-1]
            same[name] = (float((forward == backward).all(axis=1).mean()), float((forward * backward).sum(axis=1).min()))
        for _ in range(args.rounds):
            for name, embedder in recipes.items():
                started = time.perf_counter()
                embedder.embed(texts)
                seconds[name].append(time.perf_counter() - started)
    rows = [{"recipe": name, "chunks_per_s": round(len(texts) / statistics.median(s), 1),
             "rounds_s": " ".join(f"{x:.1f}" for x in s), "bitwise_same_in_any_batch": f"{same[name][0]:.0%}",
             "min_cosine_to_itself": round(same[name][1], 4)} for name, s in seconds.items()]
    print_table(rows, list(rows[0]))
    write_results("embed_batching", {"texts": len(texts), "rounds": args.rounds, "rows": rows})


if __name__ == "__main__":
    main()
