"""Parsing throughput per format, and what a process pool adds on this machine's cores.

    .venv/bin/python -m bench.parse_throughput ../shared/datasets/scifact/corpus.jsonl --per-format 40

Writes the same documents as PDF, HTML, DOCX and Markdown: each one 6 SciFact abstracts under their titles as
headings (about 1,300 words, 3-4 PDF pages). Times `parse_file` (unstructured, as kb runs it) per format in this
process, then parses all of them through kb's worker pool (`isolated_map`, the bytes shipped to the workers as the
parse stage does) with 1 and with N workers: once starting the workers (start-up included), once more on the
started pool (the parses alone).
Writes bench/results/parse_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from bench.report import print_table, write_results
from pipelines.ingest.parse import PARSER_VERSION, _parse_task, parse_file, warm_worker
from pipelines.ingest.workers import _stop_pool, isolated_map
from pipelines.settings import Limits

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "samples"))
from generate import pdf_bytes  # noqa: E402  (samples/ is not a package)

SECTIONS = 6


def write_pdf(path: Path, title: str, sections: list[tuple[str, str]]) -> None:
    lines = [("F2", 16, title[:90])]
    for heading, text in sections:
        lines.append(("F2", 13, heading[:90]))
        lines += [("F1", 10, line) for line in textwrap.wrap(text, 95)]
    pages = [lines[i:i + 45] for i in range(0, len(lines), 45)]
    path.write_bytes(pdf_bytes(pages, b"<< /Title (" + title[:80].encode("latin-1", "replace") + b") >>"))


def write_docx(path: Path, title: str, sections: list[tuple[str, str]]) -> None:
    import docx

    doc = docx.Document()
    doc.add_heading(title, level=1)
    for heading, text in sections:
        doc.add_heading(heading, level=2)
        doc.add_paragraph(text)
    doc.save(path)


def write_html(path: Path, title: str, sections: list[tuple[str, str]]) -> None:
    from html import escape

    body = "".join(f"<h2>{escape(h)}</h2><p>{escape(t)}</p>" for h, t in sections)
    path.write_text(f"<html><head><title>{escape(title)}</title></head><body><h1>{escape(title)}</h1>{body}</body></html>")


def write_md(path: Path, title: str, sections: list[tuple[str, str]]) -> None:
    path.write_text(f"# {title}\n\n" + "".join(f"## {h}\n\n{t}\n\n" for h, t in sections))


WRITERS = {"pdf": write_pdf, "html": write_html, "docx": write_docx, "md": write_md}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("corpus", type=Path)
    parser.add_argument("--per-format", type=int, default=40)
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    lines = args.corpus.read_text().splitlines()[:args.per_format * SECTIONS]
    records = [json.loads(line) for line in lines]
    with tempfile.TemporaryDirectory() as folder:
        tasks: dict[str, list[tuple[str, str]]] = {fmt: [] for fmt in WRITERS}
        for n in range(args.per_format):
            group = records[n * SECTIONS:(n + 1) * SECTIONS]
            sections = [(r["title"], r["text"]) for r in group]
            for fmt, write in WRITERS.items():
                path = Path(folder) / f"doc-{n:04d}.{fmt}"
                write(path, f"Collected abstracts {n}", sections)
                tasks[fmt].append((str(path), fmt))
        parse_file(*tasks["md"][0])  # import unstructured and its models before any clock starts
        rows = []
        for fmt, items in tasks.items():
            megabytes = sum(os.path.getsize(p) for p, _ in items) / 1e6
            started = time.perf_counter()
            elements = sum(len(parse_file(p, f).elements) for p, f in items)
            seconds = time.perf_counter() - started
            rows.append({"format": fmt, "documents": len(items), "mb": round(megabytes, 2),
                         "elements_per_doc": round(elements / len(items), 1),
                         "docs_per_s": round(len(items) / seconds, 1), "mb_per_s": round(megabytes / seconds, 2)})
        everything = [(Path(p).read_bytes(), Path(p).name, f, Limits(), PARSER_VERSION) for items in tasks.values() for p, f in items]
        cold, warm = {}, {}
        for workers in (1, args.workers):
            _stop_pool()  # each measurement starts its own workers
            for times in (cold, warm):  # the second pass reuses the started pool: the parses alone
                started = time.perf_counter()
                failures = [r for _, r in isolated_map(_parse_task, everything, workers, 600, 4000, warm_worker)
                            if isinstance(r, str)]
                times[workers] = time.perf_counter() - started
                assert not failures, failures[:3]
    n = args.workers
    result = {"per_format": rows, "mixed_documents": len(everything), "workers": n,
              "seconds_1_worker": round(cold[1], 1), f"seconds_{n}_workers": round(cold[n], 1),
              "speedup": round(cold[1] / cold[n], 2), "warm_seconds_1_worker": round(warm[1], 1),
              f"warm_seconds_{n}_workers": round(warm[n], 1), "warm_speedup": round(warm[1] / warm[n], 2)}
    print_table(rows, ["format", "documents", "mb", "elements_per_doc", "docs_per_s", "mb_per_s"])
    print(f"all {len(everything)} documents: 1 worker {cold[1]:.1f} s, {n} workers {cold[n]:.1f} s (speedup"
          f" {result['speedup']}x, worker start-up included); started pool: {warm[1]:.1f} s, {warm[n]:.1f} s"
          f" (speedup {result['warm_speedup']}x)")
    write_results("parse_throughput", result)

if __name__ == "__main__":
    main()
