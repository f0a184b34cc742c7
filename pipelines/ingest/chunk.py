"""The chunk stage: stored elements -> chunk_drafts, cut by the chunker (pipelines/ingest/chunker.py).

Drafts are the next version of a document's chunks, invisible to search until `publish` swaps them in.
"""

from __future__ import annotations

import psycopg

from pipelines.ingest.chunker import CHUNKER_VERSION, Chunker
from pipelines.ingest.elements import load_elements
from pipelines.ingest.enrich import ENRICH_VERSION
from pipelines.ingest.failures import Failure, record_failure
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.models.tokens import TokenCounter
from pipelines.settings import Limits
from pipelines.storage import bulk


def build_key(content_hash: str) -> str:
    return f"{content_hash}/{CHUNKER_VERSION}"


def publish_key(content_hash: str) -> str:
    return f"{build_key(content_hash)}/{ENRICH_VERSION}"


# Parsed documents whose live chunks are not from this content + chunker + enricher, and with no draft yet.
TO_CHUNK = """
SELECT d.document_id, d.content_hash, d.title, d.source_id, d.locator
FROM documents d
WHERE d.deleted_at IS NULL AND d.parsed_hash = d.content_hash
  AND d.published_key IS DISTINCT FROM d.content_hash || '/' || %(chunker)s || '/' || %(enricher)s
  AND NOT EXISTS (SELECT 1 FROM chunk_drafts c WHERE c.document_id = d.document_id
                  AND c.build_key = d.content_hash || '/' || %(chunker)s)
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY d.document_id
"""

DRAFT_COLUMNS = ("document_id", "ordinal", "build_key", "kind", "text", "section_path", "page_number", "token_count")


def chunk_pending(conn: psycopg.Connection, counter: TokenCounter, source_ids: list[str] | None = None,
                  batch_size: int = 256, progress: Progress = NO_PROGRESS,
                  max_chunks: int = Limits.max_chunks_per_document) -> StageReport:
    """Draft the chunks of every parsed document whose live chunks are not of its content and chunker. A document
    with more than max_chunks chunks fails alone and keeps its last good version."""
    report = StageReport("chunk", ("documents", "chunks"))
    chunker = Chunker(counter)
    pending = conn.execute(TO_CHUNK, {"chunker": CHUNKER_VERSION, "enricher": ENRICH_VERSION, "ids": source_ids}).fetchall()
    progress.total(len(pending))
    for start in range(0, len(pending), batch_size):
        batch = pending[start:start + batch_size]
        ids = [row[0] for row in batch]
        elements = load_elements(conn, ids)
        rows, too_long = [], []
        for doc_id, content_hash, title, source_id, locator in batch:
            drafts = chunker.chunk(elements[doc_id], title)
            if len(drafts) > max_chunks:
                too_long.append((Failure(source_id, locator, "chunk", f"{locator}: {len(drafts)} chunks, over the limit"
                                         f" of {max_chunks} per document (KB_MAX_CHUNKS_PER_DOCUMENT)"), content_hash))
                continue
            for ordinal, draft in enumerate(drafts):
                rows.append((doc_id, ordinal, build_key(content_hash), draft.kind, draft.text,
                             draft.section_path, draft.page_number, draft.token_count))
        with conn.transaction():
            conn.execute("DELETE FROM chunk_drafts WHERE document_id = ANY(%s)", (ids,))
            report.counts["chunks"] += bulk.copy_rows(conn, "chunk_drafts", DRAFT_COLUMNS, rows)
            for failure, content_hash in too_long:
                report.fail(failure)
                record_failure(conn, failure, content_hash)
        report.counts["documents"] += len(batch) - len(too_long)
        progress.advance(len(batch))
    return report.finish()
