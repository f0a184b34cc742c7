"""The publish stage: swap each document's drafts in as its live chunks, a batch of documents per transaction.

Drafts are matched to live chunks by the hash of their embedded text. A matched chunk keeps its row and its
vector (its position, page or entities are updated in place when they moved); a live chunk with no match is
closed (valid_to set, kept as history); a draft with no match becomes a new row. A document's new version
therefore becomes visible to search at once, and a re-run with the same input writes nothing at all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import psycopg
from psycopg import sql

from pipelines.ingest.chunk import publish_key
from pipelines.ingest.chunker import CHUNKER_VERSION
from pipelines.ingest.enrich import ENRICH_VERSION
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.storage import bulk
from pipelines.storage.vectors import model_tables

# Documents whose drafts are all enriched and embedded in every model that serves or is being built.
READY = """
SELECT d.document_id, d.content_hash, (SELECT count(*) FROM chunk_drafts c WHERE c.document_id = d.document_id)
FROM documents d
WHERE d.deleted_at IS NULL
  AND EXISTS (SELECT 1 FROM chunk_drafts c WHERE c.document_id = d.document_id)
  AND NOT EXISTS (
      SELECT 1 FROM chunk_drafts c
      WHERE c.document_id = d.document_id
        AND (c.enrich_version IS DISTINCT FROM %(enricher)s OR {missing_vector}))
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY d.document_id
"""

# Fields a kept chunk may change without being re-embedded. A chunk stores its embedded text as the prefix before its
# text (chunks.embed_text is embed_prefix || text, sql/014): the same embedded text may split differently.
MUTABLE = ("ordinal", "kind", "embed_prefix", "text", "section_path", "page_number", "token_count", "entities")
DRAFT_FIELDS = ("document_id", "text_hash") + MUTABLE

UPDATE_KEPT = """
UPDATE chunks c SET ordinal = u.ordinal, kind = u.kind, embed_prefix = u.embed_prefix, text = u.text,
    section_path = u.section_path,
    page_number = u.page_number, token_count = u.token_count, entities = u.entities,
    chunker_version = %(chunker)s, enrich_version = %(enricher)s
FROM kb_kept u WHERE c.chunk_id = u.chunk_id
"""
KEPT_SHAPE = ("chunk_id bigint, ordinal int, kind text, embed_prefix text, text text, section_path text[], page_number int,"
              " token_count int, entities jsonb")
INSERT_COLUMNS = ("document_id", "text_hash") + MUTABLE + ("chunker_version", "enrich_version")


def _diff(drafts: list[tuple], live: list[tuple]):
    """Match drafts to live chunks by text hash; returns (kept updates, inserts, chunk ids to close)."""
    live_by_hash: dict[str, list[tuple]] = defaultdict(list)
    for row in live:  # (chunk_id, text_hash, *MUTABLE, chunker_version, enrich_version)
        live_by_hash[row[1]].append(row)
    kept, inserts = [], []
    for draft in drafts:
        candidates = live_by_hash.get(draft[1])
        if candidates:
            row = candidates.pop(0)
            if tuple(row[2:]) != tuple(draft[2:]) + (CHUNKER_VERSION, ENRICH_VERSION):
                kept.append((row[0], *draft[2:]))
        else:
            inserts.append(tuple(draft) + (CHUNKER_VERSION, ENRICH_VERSION))
    closed = [row[0] for rows in live_by_hash.values() for row in rows]
    return kept, inserts, closed


def publish_batch(conn: psycopg.Connection, batch: list[tuple[int, str]], report: StageReport) -> None:
    ids = [doc_id for doc_id, _ in batch]
    with conn.transaction():
        # Lock the documents so that two runs publishing the same document serialise here.
        conn.execute("SELECT 1 FROM documents WHERE document_id = ANY(%s) ORDER BY document_id FOR UPDATE", (ids,))
        drafts = conn.execute(
            sql.SQL("SELECT {} FROM chunk_drafts WHERE document_id = ANY(%s) ORDER BY document_id, ordinal").format(
                sql.SQL(", ").join(map(sql.Identifier, DRAFT_FIELDS))), (ids,)).fetchall()
        live = conn.execute(
            sql.SQL("SELECT document_id, chunk_id, text_hash, {}, chunker_version, enrich_version FROM chunks"
                    " WHERE document_id = ANY(%s) AND valid_to IS NULL AND kind <> 'card'"
                    " ORDER BY document_id, ordinal").format(
                sql.SQL(", ").join(map(sql.Identifier, MUTABLE))), (ids,)).fetchall()
        drafts_by_doc, live_by_doc = defaultdict(list), defaultdict(list)
        for row in drafts:
            drafts_by_doc[row[0]].append(row)
        for row in live:
            live_by_doc[row[0]].append(row[1:])
        kept, inserts, closed, versions = [], [], [], []
        for doc_id, content_hash in batch:
            k, i, c = _diff(drafts_by_doc[doc_id], live_by_doc[doc_id])
            kept += k
            inserts += i
            closed += c
            versions.append((doc_id, content_hash, len(i), len(c), len(drafts_by_doc[doc_id]) - len(i)))
        if closed:  # a closed chunk's Q&A cards close with it
            conn.execute("UPDATE chunks SET valid_to = now() WHERE (chunk_id = ANY(%(ids)s) OR source_chunk_id = ANY(%(ids)s))"
                         " AND valid_to IS NULL", {"ids": closed})
        if kept:
            bulk.stage_rows(conn, "kb_kept", KEPT_SHAPE, ("chunk_id",) + MUTABLE, kept)
            conn.execute(UPDATE_KEPT, {"chunker": CHUNKER_VERSION, "enricher": ENRICH_VERSION})
        if inserts:
            bulk.copy_rows(conn, "chunks", INSERT_COLUMNS, inserts)
        conn.execute(
            "UPDATE documents d SET published_key = u.key FROM unnest(%s::bigint[], %s::text[]) AS u(id, key)"
            " WHERE d.document_id = u.id",
            (ids, [publish_key(h) for _, h in batch]),
        )
        conn.execute(
            "SELECT kb_record_version(v.id, 'published', v.hash, v.added, v.closed, v.kept)"
            " FROM unnest(%s::bigint[], %s::text[], %s::int[], %s::int[], %s::int[]) AS v(id, hash, added, closed, kept)",
            [list(column) for column in zip(*versions)],
        )
        conn.execute("DELETE FROM chunk_drafts WHERE document_id = ANY(%s)", (ids,))
        # A document that publishes was chunked and embedded: its failures at those stages are fixed.
        conn.execute("DELETE FROM failures f USING documents d WHERE d.document_id = ANY(%s) AND f.source_id = d.source_id"
                     " AND f.locator = d.locator AND f.stage IN ('chunk', 'embed')", (ids,))
    report.counts["documents"] += len(batch)
    report.counts["chunks_inserted"] += len(inserts)
    report.counts["chunks_updated"] += len(kept)
    report.counts["chunks_closed"] += len(closed)
    report.counts["chunks_kept"] += sum(len(drafts_by_doc[d]) for d in ids) - len(inserts)


# Documents the last crawl found gone (extract marks them, sql/015): deleted here, in the gated transaction that
# publishes the rest of the refresh, so that a renamed file is never missing from search in between and a refresh
# that only deletes passes the golden-set gate like any other. Only documents that served (live chunks) count as
# deleted (extract already forgot those that never did).
VANISHED = """
SELECT d.source_id, array_agg(d.locator ORDER BY d.locator),
       count(*) FILTER (WHERE EXISTS (SELECT 1 FROM chunks c WHERE c.document_id = d.document_id AND c.valid_to IS NULL))
FROM documents d
WHERE d.vanished_at IS NOT NULL AND d.deleted_at IS NULL AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
GROUP BY d.source_id ORDER BY d.source_id
"""


def delete_vanished(conn: psycopg.Connection, source_ids: list[str] | None, report: StageReport) -> None:
    for source_id, locators, served in conn.execute(VANISHED, {"ids": source_ids}).fetchall():
        conn.execute("SELECT kb_soft_delete_documents(%s, %s)", (source_id, locators))
        conn.execute("UPDATE documents SET vanished_at = NULL WHERE source_id = %s AND locator = ANY(%s)",
                     (source_id, locators))
        report.counts["deleted"] += served


# The drafts one batch publishes at most (a single document with more is a batch of its own). The lexical bookkeeping
# (sql/functions/lexical.sql) updates each term a batch touches once, so that fewer, larger batches publish faster
# (600 SciFact records: 3.1 s in batches of 64 documents, 1.6 s in batches of 512, about 1,000 chunks), while the
# drafts a batch holds in memory stay bounded however long its documents are.
BATCH_CHUNKS = 2_000


def _batches(ready: list[tuple[int, str, int]], documents: int) -> Iterator[list[tuple[int, str]]]:
    """`ready` (document, hash, drafts) cut into batches of at most `documents` documents and BATCH_CHUNKS drafts."""
    batch: list[tuple[int, str]] = []
    held = 0
    for document_id, content_hash, drafts in ready:
        if batch and (len(batch) >= documents or held + drafts > BATCH_CHUNKS):
            yield batch
            batch, held = [], 0
        batch.append((document_id, content_hash))
        held += drafts
    if batch:
        yield batch


def publish_ready(conn: psycopg.Connection, source_ids: list[str] | None = None, batch_size: int = 1_000,
                  progress: Progress = NO_PROGRESS, model_keys: list[str] | None = None) -> StageReport:
    """Delete what the crawl found gone, then publish the documents whose drafts have vectors in every model of
    `model_keys` (the run's: the configured and the serving model; default every registered one). The run calls it
    inside one transaction with the golden-set gate (pipelines/ingest/run.py)."""
    report = StageReport("publish", ("documents", "deleted", "chunks_inserted", "chunks_updated", "chunks_closed",
                                     "chunks_kept"))
    delete_vanished(conn, source_ids, report)
    tables = [table for key, table in model_tables(conn).items() if model_keys is None or key in model_keys]
    if not tables:
        raise LookupError("no embedding model registered: run the embed stage first")
    missing = sql.SQL(" OR ").join(
        sql.SQL("NOT EXISTS (SELECT 1 FROM {} v WHERE v.text_hash = c.text_hash)").format(sql.Identifier(table))
        for table in tables)
    ready = conn.execute(sql.SQL(READY).format(missing_vector=missing),
                         {"enricher": ENRICH_VERSION, "ids": source_ids}).fetchall()
    progress.total(len(ready))
    for batch in _batches(ready, batch_size):
        publish_batch(conn, batch, report)
        progress.advance(len(batch))
    report.counts["chunks_written"] = report.counts["chunks_inserted"] + report.counts["chunks_updated"] + report.counts["chunks_closed"]
    return report.finish()
