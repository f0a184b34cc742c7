"""The chunk and enrich stages: stored elements -> chunk_drafts -> enriched chunk_drafts.

Drafts are the next version of a document's chunks, invisible to search until `publish` swaps them in.
"""

from __future__ import annotations

import psycopg
from psycopg.types.json import Jsonb

from pipelines import bulk
from pipelines.chunking import CHUNKER_VERSION, Chunker
from pipelines.elements import load_elements
from pipelines.enrich import ENRICH_VERSION, context_title, embed_text, extract_entities
from pipelines.hashing import hash_text
from pipelines.failures import Failure, record_failure
from pipelines.report import NO_PROGRESS, Progress, StageReport
from pipelines.settings import Limits
from pipelines.tokens import TokenCounter


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


TO_ENRICH = """
SELECT c.document_id, c.ordinal, d.title, c.section_path, c.text
FROM chunk_drafts c JOIN documents d USING (document_id)
WHERE c.enrich_version IS DISTINCT FROM %(enricher)s
  AND (c.document_id, c.ordinal) > (%(after_doc)s, %(after_ordinal)s)
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY c.document_id, c.ordinal
LIMIT %(limit)s
"""

ENRICHED_SHAPE = "document_id bigint, ordinal int, embed_text text, text_hash text, entities jsonb, token_count int"
ENRICHED_COLUMNS = ("document_id", "ordinal", "embed_text", "text_hash", "entities", "token_count")


def enrich_pending(conn: psycopg.Connection, counter: TokenCounter, source_ids: list[str] | None = None,
                   batch_size: int = 2000, progress: Progress = NO_PROGRESS) -> StageReport:
    """Fill in what gets embedded; token_count becomes the count of the embedded text, the one that must fit."""
    report = StageReport("enrich", ("chunks",))
    after = (0, 0)  # keyset pagination: drafts stream in batches, never all in memory
    params = {"enricher": ENRICH_VERSION, "ids": source_ids, "limit": batch_size}
    progress.total(conn.execute(f"SELECT count(*) FROM ({TO_ENRICH}) t",
                                {**params, "limit": None, "after_doc": 0, "after_ordinal": 0}).fetchone()[0])
    while rows := conn.execute(TO_ENRICH, {**params, "after_doc": after[0], "after_ordinal": after[1]}).fetchall():
        texts = [embed_text(context_title(counter, title), path, text) for _, _, title, path, text in rows]
        enriched = [(doc_id, ordinal, full, hash_text(full), Jsonb(extract_entities(full)), tokens)
                    for (doc_id, ordinal, *_), full, tokens in zip(rows, texts, counter.count(texts))]
        with conn.transaction():
            bulk.stage_rows(conn, "kb_enriched", ENRICHED_SHAPE, ENRICHED_COLUMNS, enriched)
            conn.execute(
                "UPDATE chunk_drafts c SET embed_text = e.embed_text, text_hash = e.text_hash, entities = e.entities,"
                " token_count = e.token_count, enrich_version = %s FROM kb_enriched e WHERE c.document_id = e.document_id AND c.ordinal = e.ordinal",
                (ENRICH_VERSION,),
            )
        report.counts["chunks"] += len(rows)
        progress.advance(len(rows))
        after = rows[-1][:2]
    return report.finish()
