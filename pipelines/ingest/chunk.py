"""The chunk stage: stored elements -> chunk_drafts, cleaned (pipelines/ingest/clean.py) and cut by the chunker
(pipelines/ingest/chunker.py).

Drafts are the next version of a document's chunks, invisible to search until `publish` swaps them in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Iterator

import psycopg

from pipelines.ingest.chunker import CHUNKER_VERSION, ChunkDraft, Chunker
from pipelines.ingest.clean import clean, normalise
from pipelines.ingest.elements import load_elements
from pipelines.ingest.enrich import ENRICH_VERSION
from pipelines.ingest.failures import Failure, record_failure
from pipelines.ingest.parse import warm_worker
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.ingest.workers import Lost, Workers, running_pool, spread_map
from pipelines.models.tokens import TokenCounter
from pipelines.settings import Limits
from pipelines.storage import bulk


def build_key(content_hash: str) -> str:
    return f"{content_hash}/{CHUNKER_VERSION}"


def publish_key(content_hash: str) -> str:
    return f"{build_key(content_hash)}/{ENRICH_VERSION}"


# Parsed documents whose live chunks are not from this content + chunker + enricher, and with no draft yet.
TO_CHUNK = """
SELECT d.document_id, d.content_hash, d.title, d.source_id, d.locator, d.doc_format
FROM documents d
WHERE d.deleted_at IS NULL AND d.parsed_hash = d.content_hash
  AND d.published_key IS DISTINCT FROM d.content_hash || '/' || %(chunker)s || '/' || %(enricher)s
  AND NOT EXISTS (SELECT 1 FROM chunk_drafts c WHERE c.document_id = d.document_id
                  AND c.build_key = d.content_hash || '/' || %(chunker)s)
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY d.document_id
"""

# Below this many batches the chunker runs in this process, unless the parse stage already started the workers:
# starting them (each imports unstructured and spaCy, 1-3 s) costs more than chunking a few hundred documents.
SPREAD_FROM_BATCHES = 8

DRAFT_COLUMNS = ("document_id", "ordinal", "build_key", "kind", "text", "section_path", "page_number", "token_count")


def chunk_pending(conn: psycopg.Connection, counter: TokenCounter, source_ids: list[str] | None = None,
                  batch_size: int = 64, progress: Progress = NO_PROGRESS, limits: Limits = Limits(),
                  workers: Workers | int = 1) -> StageReport:
    """Draft the chunks of every parsed document whose live chunks are not of its content and chunker, a batch of
    documents per transaction. A document with more than limits.max_chunks_per_document chunks fails alone and
    keeps its last good version. The chunker is pure CPU (the tokenizer, the sentence splitter): with more than one
    worker and enough batches (SPREAD_FROM_BATCHES, or a pool the parse stage started), batches are cut by the run's
    workers (`spread_map`, as parsing), each stored as it comes back while the workers go on."""
    report = StageReport("chunk", ("documents", "chunks"))
    workers = workers if isinstance(workers, Workers) else Workers(workers)
    pending = conn.execute(TO_CHUNK, {"chunker": CHUNKER_VERSION, "enricher": ENRICH_VERSION, "ids": source_ids}).fetchall()
    progress.total(len(pending))
    batches = [pending[start:start + batch_size] for start in range(0, len(pending), batch_size)]

    def tasks() -> Iterator[tuple[str, tuple]]:
        for n, batch in enumerate(batches):
            elements = load_elements(conn, [row[0] for row in batch])
            yield f"chunk batch {n}", (counter, [(elements[row[0]], row[2], row[5]) for row in batch])

    spread = _spread_to(workers, len(batches))
    if spread:
        # no time or memory limit: the chunker is kb's own code on elements parsing already bounded, as in process
        results = spread_map(_chunk_task, tasks(), spread, None, float("inf"), warm_worker)
    else:
        results = ((i, None, _chunk_task(task)) for i, (_, task) in enumerate(tasks()))
    chunked_by: Counter[str] = Counter()
    for i, worker, drafted in results:
        batch = batches[i]
        if worker is not None:
            chunked_by[worker] += 1
        if isinstance(drafted, Lost):
            drafted = [drafted] * len(batch)
        rows, failed = [], []
        for (doc_id, content_hash, _, source_id, locator, _), drafts in zip(batch, drafted):
            reason = _refused(drafts, limits.max_chunks_per_document)
            if reason:
                failed.append((Failure(source_id, locator, "chunk", f"{locator}: {reason}"), content_hash))
                continue
            for ordinal, draft in enumerate(drafts):
                rows.append((doc_id, ordinal, build_key(content_hash), draft.kind, draft.text,
                             draft.section_path, draft.page_number, draft.token_count))
        with conn.transaction():
            conn.execute("DELETE FROM chunk_drafts WHERE document_id = ANY(%s)", ([row[0] for row in batch],))
            report.counts["chunks"] += bulk.copy_rows(conn, "chunk_drafts", DRAFT_COLUMNS, rows)
            for failure, content_hash in failed:
                report.fail(failure)
                record_failure(conn, failure, content_hash)
        report.counts["documents"] += len(batch) - len(failed)
        progress.advance(len(batch))
    if chunked_by:
        report.notes["workers"] = dict(sorted(chunked_by.items()))  # batches per worker
    return report.finish()


def _spread_to(workers: Workers, batches: int) -> Workers | None:
    """The workers that cut the batches, or None to cut them in this process (see SPREAD_FROM_BATCHES). A pool the
    parse stage started is used at its size, never stopped for one of another size."""
    if workers.dask:
        return workers if batches >= SPREAD_FROM_BATCHES else None
    running = running_pool(warm_worker)
    if workers.processes > 1 and running > 1 and batches > 1:
        return replace(workers, processes=running)
    processes = min(workers.processes, batches)
    return replace(workers, processes=processes) if processes > 1 and batches >= SPREAD_FROM_BATCHES else None


def _chunk_task(task: tuple) -> list[list[ChunkDraft] | str]:
    """A batch's unit of work, here or on a worker: each document's drafts, or why it could not be chunked (a bug of
    the chunker or of a library it calls costs that document only). The counter travels as what to build, not as this
    machine's paths, and is built once per process (see pipelines/models/tokens.py)."""
    counter, documents = task
    chunker = Chunker(counter)
    return [_drafts(chunker, elements, title, doc_format) for elements, title, doc_format in documents]


def _drafts(chunker: Chunker, elements: list, title: str | None, doc_format: str) -> list[ChunkDraft] | str:
    try:
        return chunker.chunk(clean(elements, doc_format), title and normalise(title))
    except Exception as exc:
        return (f"cannot chunk: {type(exc).__name__}: {exc} (kb's chunker failed on this document, which keeps its"
                " last version: please report it with the file)")


def _refused(drafts: list[ChunkDraft] | Lost | str, max_chunks: int) -> str | None:
    """Why a document's drafts are not stored: its chunking failed, it has too many chunks, or its batch's worker was
    lost."""
    if isinstance(drafts, str):
        return drafts
    if isinstance(drafts, Lost):
        return f"chunking stopped: {drafts.reason}"
    if len(drafts) > max_chunks:
        return f"{len(drafts)} chunks, over the limit of {max_chunks} per document (KB_MAX_CHUNKS_PER_DOCUMENT)"
    return None
