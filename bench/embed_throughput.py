"""Local embedding throughput: torch fp32 (sentence-transformers) against the int8 ONNX graph, same texts.

    .venv/bin/python -m bench.embed_throughput ../shared/datasets/scifact/corpus.jsonl --texts 1000

Texts are SciFact records as kb embeds a one-chunk record (title, blank line, abstract; both models cut at 256
word pieces). Reports chunks/s for each, the one-off export time of the ONNX graph into an empty cache, and
how close the int8 vectors are to fp32 (cosine per text). Writes bench/results/embed_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import print_table, write_results
from pipelines.ingest.enrich import embed_text
from pipelines.models.embedders import OnnxEmbedder, TorchEmbedder


def timed(embedder, texts: list[str]) -> tuple[np.ndarray, float]:
    embedder.embed(texts[:16])  # load the model and warm up before the clock starts
    started = time.perf_counter()
    vectors = embedder.embed(texts)
    return vectors, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--texts", type=int, default=1000)
    args = parser.parse_args()
    records = [json.loads(line) for line in args.corpus.read_text().splitlines()[:args.texts]]
    texts = [embed_text(r.get("title"), [], r["text"]) for r in records]

    with tempfile.TemporaryDirectory() as cache:
        onnx = OnnxEmbedder(Path(cache))
        started = time.perf_counter()
        onnx._session  # noqa: B018 - forces the export into the empty cache
        export_s = time.perf_counter() - started
        int8, int8_s = timed(onnx, texts)
    fp32, fp32_s = timed(TorchEmbedder(), texts)
    cosine = (int8 * fp32).sum(axis=1)
    rows = [
        {"embedder": "torch fp32 (sentence-transformers, batch 64)", "chunks_per_s": round(len(texts) / fp32_s, 1),
         "seconds": round(fp32_s, 1)},
        {"embedder": "onnx int8 (onnxruntime, each text alone)", "chunks_per_s": round(len(texts) / int8_s, 1),
         "seconds": round(int8_s, 1)},
    ]
    result = {"texts": len(texts), "mean_word_pieces": round(float(np.mean(onnx.counter.count(texts))), 1),
              "rows": rows, "speedup": round(fp32_s / int8_s, 2), "onnx_export_s": round(export_s, 1),
              "cosine_int8_vs_fp32": {"min": round(float(cosine.min()), 4), "mean": round(float(cosine.mean()), 4)}}
    print_table(rows, ["embedder", "chunks_per_s", "seconds"])
    print(f"speedup {result['speedup']}x, export once {result['onnx_export_s']} s, "
          f"cosine min {result['cosine_int8_vs_fp32']['min']} mean {result['cosine_int8_vs_fp32']['mean']}")
    write_results("embed_throughput", result)

if __name__ == "__main__":
    main()
