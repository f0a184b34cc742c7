"""Extraction: walk each source, record every document's identity, size, mtime and content hash.

A file whose size and mtime match the stored row is not read again (the cheap stat check); any other file
is hashed. JSONL records are small and already structured, so extraction also stores their elements.
"""

from __future__ import annotations

import fnmatch
import json
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import psycopg

from pipelines import bulk
from pipelines.failures import Failure, clear_failures, record_failure
from pipelines.formats import UnsupportedFormat, format_of
from pipelines.hashing import hash_file, hash_text
from pipelines.report import StageReport
from pipelines.elements import Element, ParsedDocument, write_elements
from pipelines.sources import Source, source_file

STAGE = "extract"


@dataclass(frozen=True)
class Found:
    locator: str
    doc_format: str
    size: int
    mtime: datetime | None
    content_hash: str | None  # None: unchanged by the stat check, keep the stored hash
    record: dict | None = None
    failed: bool = False


def _selected(relpath: str, source: Source) -> bool:
    if source.include and not any(fnmatch.fnmatch(relpath, g) for g in source.include):
        return False
    return not any(fnmatch.fnmatch(relpath, g) for g in source.exclude)


Known = dict[str, tuple[int, "datetime | None", str]]  # locator -> (size, mtime, content_hash)


def walk_folder(source: Source, known: Known, report: StageReport) -> Iterator[Found]:
    """Yield the folder's files in a stable order; hidden files and folders are skipped."""
    root = Path(source.location)
    if not root.is_dir():
        raise FileNotFoundError(f"source {source.source_id!r}: folder {root} does not exist")
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(f for f in filenames if not f.startswith(".")):
            path = Path(dirpath) / name
            relpath = path.relative_to(root).as_posix()
            if not _selected(relpath, source):
                continue
            try:
                found = _inspect_file(source_file(source.location, relpath, source.allow_outside_links), relpath,
                                      known.get(relpath))
            except (OSError, UnsupportedFormat, ValueError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                report.fail(Failure(source.source_id, relpath, STAGE, f"cannot read {path}: {reason}"
                                    if isinstance(exc, OSError) else f"{path}: {reason}"))
                yield Found(relpath, "", 0, None, None, failed=True)
                continue
            yield found


def _inspect_file(path: Path, relpath: str, stored: tuple[int, datetime | None, str] | None) -> Found:
    doc_format = format_of(path)
    stat = path.stat()
    mtime = datetime.fromtimestamp(stat.st_mtime, tz=timezone.utc)
    if stat.st_size == 0:
        raise ValueError("empty file (0 bytes)")
    if stored is not None and stored[:2] == (stat.st_size, mtime):
        return Found(relpath, doc_format, stat.st_size, mtime, None)
    digest, size = hash_file(str(path))
    return Found(relpath, doc_format, size, mtime, digest)


def read_records(source: Source, report: StageReport) -> Iterator[Found]:
    """Yield each JSONL record (`_id`, `title`, `text`); a bad line is a failure naming file and line."""
    with open(source.location, encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                if not isinstance(record, dict) or "_id" not in record:
                    raise ValueError("record has no _id")
                if not str(record.get("text", "")).strip() and not str(record.get("title", "")).strip():
                    raise ValueError("record has no title and no text")
            except ValueError as exc:
                report.fail(Failure(source.source_id, f"line {line_no}", STAGE,
                                    f"{source.location} line {line_no}: {exc}"))
                continue
            canonical = json.dumps(record, sort_keys=True, ensure_ascii=False)
            yield Found(str(record["_id"]), "record", len(canonical.encode()), None, hash_text(canonical), record)


def record_elements(record: dict) -> ParsedDocument:
    """A record is already structured: its title is the heading, each paragraph of its text an element."""
    title = str(record.get("title") or "").strip()
    paragraphs = [p.strip() for p in str(record.get("text") or "").split("\n\n") if p.strip()]
    path = [title] if title else []
    elements = [Element("Title", title, depth=0, section_path=path)] if title else []
    elements += [Element("NarrativeText", p, section_path=path) for p in paragraphs]
    metadata = {k: v for k, v in record.items() if k not in ("_id", "title", "text")}
    return ParsedDocument(elements, title or None, metadata)


def _known_documents(conn: psycopg.Connection, source_id: str) -> Known:
    rows = conn.execute(
        "SELECT locator, size_bytes, mtime, content_hash FROM documents WHERE source_id = %s AND deleted_at IS NULL",
        (source_id,),
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


MERGE_DOCUMENTS = """
WITH merged AS (
    INSERT INTO documents AS d (source_id, locator, doc_format, size_bytes, mtime, content_hash, title)
    SELECT %(source_id)s, s.locator, s.doc_format, s.size_bytes, s.mtime, s.content_hash, s.title FROM kb_found s
    ON CONFLICT (source_id, locator) DO UPDATE
        SET doc_format = excluded.doc_format, size_bytes = excluded.size_bytes, mtime = excluded.mtime,
            content_hash = excluded.content_hash, deleted_at = NULL
        WHERE (d.doc_format, d.size_bytes, d.mtime, d.content_hash, d.deleted_at)
              IS DISTINCT FROM (excluded.doc_format, excluded.size_bytes, excluded.mtime, excluded.content_hash, NULL)
    RETURNING d.document_id, d.locator
)
SELECT document_id, locator FROM merged
"""

FOUND_COLUMNS = ("locator", "doc_format", "size_bytes", "mtime", "content_hash", "title")
FOUND_SHAPE = "locator text, doc_format text, size_bytes bigint, mtime timestamptz, content_hash text, title text"


def _write_batch(conn: psycopg.Connection, source: Source, batch: list[Found], known: Known, report: StageReport) -> None:
    readable = [f for f in batch if not f.failed]
    for f in readable:
        stored = known.get(f.locator)
        kind = "new" if stored is None else "unchanged" if f.content_hash in (None, stored[2]) else "changed"
        report.counts[kind] += 1
    changed = [f for f in readable if f.content_hash is not None]
    bulk.stage_rows(conn, "kb_found", FOUND_SHAPE, FOUND_COLUMNS, (
        (f.locator, f.doc_format, f.size, f.mtime, f.content_hash, (f.record or {}).get("title") or None)
        for f in changed))
    rows = conn.execute(MERGE_DOCUMENTS, {"source_id": source.source_id}).fetchall()
    by_locator = {f.locator: f for f in changed}
    records = [(doc_id, by_locator[locator]) for doc_id, locator in rows if by_locator[locator].record is not None]
    if records:
        write_elements(conn, [(doc_id, f.content_hash, record_elements(f.record)) for doc_id, f in records])
    clear_failures(conn, source.source_id, [f.locator for f in readable], STAGE)


def crawl_source(conn: psycopg.Connection, source: Source, report: StageReport, batch_size: int = 500) -> None:
    """Crawl one source: upsert what changed, soft-delete what disappeared, all in one transaction."""
    with conn.transaction():
        known = _known_documents(conn, source.source_id)
        found = walk_folder(source, known, report) if source.kind == "folder" else read_records(source, report)
        seen: list[str] = []
        batch: list[Found] = []
        failures_before = len(report.failures)
        for item in found:
            seen.append(item.locator)
            report.counts["seen"] += 1
            batch.append(item)
            if len(batch) >= batch_size:
                _write_batch(conn, source, batch, known, report)
                batch = []
        if batch:
            _write_batch(conn, source, batch, known, report)
        for failure in report.failures[failures_before:]:
            record_failure(conn, failure, None)
        deleted = conn.execute(
            "SELECT kb_soft_delete_missing(%s, %s)", (source.source_id, seen)
        ).fetchone()[0]
        report.counts["deleted"] += deleted
        conn.execute("UPDATE sources SET last_crawled_at = now() WHERE source_id = %s", (source.source_id,))
        conn.execute("UPDATE documents SET stale_since = NULL WHERE source_id = %s AND stale_since IS NOT NULL",
                     (source.source_id,))


def extract(conn: psycopg.Connection, sources: list[Source]) -> StageReport:
    report = StageReport(STAGE, ("seen", "new", "changed", "unchanged", "deleted"))
    for source in sources:
        try:
            crawl_source(conn, source, report)
        except (OSError, ValueError) as exc:
            report.fail(Failure(source.source_id, source.location, STAGE, f"cannot crawl source: {exc}"))
    return report.finish()
