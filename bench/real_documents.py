"""The parse stage on files that real tools produced, against unstructured alone on the same files and the same number
of worker processes (issue 32, item 3).

    .venv/bin/python -m bench.real_documents FOLDER [--workers N] [--passes 2]

FOLDER holds PDF, DOCX, PPTX and HTML files, any depth (bench/README.md says which public files were used). Each
pass runs both sides, one after the other, each on workers started for it (start-up included):
- unstructured alone: each file's partitioner with the arguments kb gives it (pipelines/ingest/parse.py
  PARTITIONERS, `languages=["eng"]`, the file read by unstructured), in a `concurrent.futures` process pool of N
  spawned workers that load what kb's workers load (`warm_worker`: unstructured's core, the offline sentence model);
- kb: the parse stage's own pool (`isolated_map` over `_parse_task`): the bytes shipped to the worker, the limits
  checked (zip expansion, decoding), unstructured's elements converted to kb's, file metadata read, under the
  stage's per-file timeout and memory watchdog set looser than its defaults (TIMEOUT_S, MEMORY_MB).
The ratio is kb over unstructured alone. Pages are what unstructured numbers (PDF pages, PPTX slides); pages per
second per core are those pages over kb's best time and the workers (`--formats pdf` for PDF alone).
Writes bench/results/real_documents.json.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from bench.report import print_table, write_results
from pipelines.ingest.formats import format_of, supported
from pipelines.ingest.parse import PARSER_VERSION, PARTITIONERS, _parse_task, warm_worker
from pipelines.ingest.workers import _stop_pool, isolated_map
from pipelines.settings import Limits

BENCHED = {"pdf", "docx", "pptx", "html"}
# Looser than the stage's defaults (Limits: 120 s and 1,024 MB per file), so that a slow or large file is timed on
# both sides, not cut on kb's alone.
TIMEOUT_S = 600
MEMORY_MB = 4000


def _alone(task: tuple[str, str]) -> tuple[int, int] | str:
    """unstructured's partitioner on one file: (elements with text, highest page number), or why it failed."""
    path, doc_format = task
    module, function, extra = PARTITIONERS[doc_format]
    try:
        elements = getattr(importlib.import_module(module), function)(filename=path, languages=["eng"], **extra)
    except Exception as exc:  # noqa: BLE001 - a file unstructured cannot read is counted, as kb counts it
        return f"{type(exc).__name__}: {exc}"
    return sum(bool((e.text or "").strip()) for e in elements), max((e.metadata.page_number or 0 for e in elements),
                                                                    default=0)


def run_alone(files: list[tuple[str, str]], workers: int) -> tuple[float, dict[str, tuple[int, int] | str]]:
    started = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=warm_worker) as pool:
        futures = {pool.submit(_alone, task): task[0] for task in files}
        results = {futures[f]: f.result(timeout=TIMEOUT_S) for f in as_completed(futures)}
    return time.perf_counter() - started, results


def run_kb(files: list[tuple[str, str]], workers: int) -> tuple[float, dict[str, object]]:
    _stop_pool()  # workers started for this pass, as for the other side
    started = time.perf_counter()
    tasks = [(Path(path).read_bytes(), path, doc_format, Limits(), PARSER_VERSION) for path, doc_format in files]
    results = {files[i][0]: result for i, result in isolated_map(_parse_task, tasks, workers, TIMEOUT_S, MEMORY_MB,
                                                                  warm_worker)}
    seconds = time.perf_counter() - started
    _stop_pool()
    return seconds, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--formats", default=",".join(sorted(BENCHED)), help="e.g. pdf: pages per second of PDF alone")
    args = parser.parse_args()
    formats = set(args.formats.split(",")) & BENCHED
    files = sorted((str(p), format_of(p)) for p in args.folder.rglob("*")
                   if p.is_file() and supported(p) and format_of(p) in formats)
    counts = Counter(doc_format for _, doc_format in files)
    megabytes = sum(os.path.getsize(p) for p, _ in files) / 1e6
    print(f"{len(files)} files ({dict(counts)}), {megabytes:.1f} MB, {args.workers} workers")
    passes = []
    for _ in range(args.passes):
        alone_s, alone = run_alone(files, args.workers)
        kb_s, kb = run_kb(files, args.workers)
        passes.append({"alone_s": round(alone_s, 1), "kb_s": round(kb_s, 1), "ratio": round(kb_s / alone_s, 2)})
    pages = Counter()
    for path, doc_format in files:
        if isinstance(alone[path], tuple):
            pages[doc_format] += alone[path][1]
    failed_alone = sorted(p for p, r in alone.items() if isinstance(r, str) or r[0] == 0)  # kb: "no text"
    failed_kb = sorted(p for p, r in kb.items() if isinstance(r, str) or not hasattr(r, "elements"))
    best_kb = min(p["kb_s"] for p in passes)
    result = {"files": len(files), "per_format": dict(counts), "mb": round(megabytes, 1), "workers": args.workers,
              "passes": passes, "pages": dict(pages),
              "pages_per_s_per_core": round(sum(pages.values()) / best_kb / args.workers, 2),
              "failed_alone": failed_alone, "failed_kb": failed_kb}
    print_table(passes, ["alone_s", "kb_s", "ratio"])
    print(f"pages: {dict(pages)}; failed: unstructured alone {len(failed_alone)}, kb {len(failed_kb)}")
    for path in sorted(set(failed_kb) ^ set(failed_alone)):
        print(f"  only one side failed: {path}: alone {alone[path]!s:.120} | kb {kb[path]!s:.120}")
    print(f"results: {write_results('real_documents', result)}")


if __name__ == "__main__":
    main()
