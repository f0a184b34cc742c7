"""Chunking time against document size: it must grow linearly (issue 10 found 40k sentences 17 s, 80k 58 s).

    .venv/bin/python -m bench.chunking --sentences 10000 --sentences 20000 --sentences 40000 --sentences 80000

One section of N sentences in paragraphs of 5 (the shape of a long DOCX), chunked with the real all-MiniLM-L6-v2
tokenizer and spaCy sentencizer. Also one paragraph-free run of base64 (a 300 KB token), which must be cut into
chunks that fit. Writes bench/results/chunking.json.
"""

from __future__ import annotations

import argparse
import base64
import time

import numpy as np

from bench.report import print_table, write_results
from pipelines.ingest.chunker import Chunker
from pipelines.ingest.elements import Element
from pipelines.models.tokens import local_counter

SENTENCE = "The cooling fan of drive number {n} must be replaced after thirty thousand operating hours."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sentences", type=int, action="append", required=True)
    args = parser.parse_args()
    chunker = Chunker(local_counter())
    chunker.chunk([Element("NarrativeText", "Warm up the tokenizer and spaCy.")], "Warm-up")
    rows = []
    for count in args.sentences:
        paragraphs = [" ".join(SENTENCE.format(n=i + j) for j in range(5)) for i in range(0, count, 5)]
        elements = [Element("NarrativeText", text, section_path=["Manual"]) for text in paragraphs]
        started = time.perf_counter()
        chunks = chunker.chunk(elements, "Maintenance manual")
        seconds = time.perf_counter() - started
        rows.append({"sentences": count, "chunks": len(chunks), "seconds": round(seconds, 2),
                     "us_per_sentence": round(seconds / count * 1e6, 1)})
    blob = base64.b64encode(np.random.default_rng(3).bytes(225_000)).decode()
    started = time.perf_counter()
    chunks = chunker.chunk([Element("NarrativeText", blob)], "Keys")
    token = {"token_kb": round(len(blob) / 1000), "chunks": len(chunks), "seconds": round(time.perf_counter() - started, 2),
             "largest_chunk_tokens": max(local_counter().count([c.text for c in chunks]))}
    print_table(rows, ["sentences", "chunks", "seconds", "us_per_sentence"])
    print(f"a {token['token_kb']} KB token: {token['chunks']} chunks in {token['seconds']} s, the largest"
          f" {token['largest_chunk_tokens']} tokens (limit {local_counter().max_tokens})")
    write_results("chunking", {"sizes": rows, "long_token": token})


if __name__ == "__main__":
    main()
