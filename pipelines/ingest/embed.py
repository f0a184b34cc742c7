"""The embed stage: vectors for every embedded text that the current model has not seen yet.

Vectors are keyed by (model, hash of the embedded text): unchanged chunks, duplicate passages and restored
documents reuse what is stored and never reach the model. Every vector is checked before it is stored (right
dimension, finite, unit length: all-zero and NaN vectors are refused), so a model or endpoint that returns garbage
fails the documents of that batch for this run, which keep their last good version, and nothing bad is cached.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, replace
from functools import cache

import numpy as np
import psycopg
from psycopg import sql

from pipelines.ingest.failures import Failure, record_failure
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.ingest.workers import Lost, dask_map
from pipelines.models.embedders import Embedder, embedder_for
from pipelines.settings import Settings
from pipelines.storage import bulk
from pipelines.storage.database import connect, database_url
from pipelines.storage.vectors import (
    active_model,
    defer_index,
    ensure_index,
    ensure_vector_store,
    registered_dimensions,
)

# Texts of drafts and of live chunks with no vector in this model's table. Optionally limited to some sources and to
# shards of the hash space (first hex digit), which is how a model backfill and a dask run fan out.
MISSING = """
SELECT t.text_hash, min(t.embed_text) FROM (
    SELECT c.text_hash, c.embed_text, c.document_id FROM chunk_drafts c WHERE c.text_hash IS NOT NULL
    UNION ALL
    SELECT c.text_hash, c.embed_text, c.document_id FROM chunks c WHERE c.valid_to IS NULL
) t
WHERE NOT EXISTS (SELECT 1 FROM {vectors} v WHERE v.text_hash = t.text_hash)
  AND (%(shards)s::text[] IS NULL OR left(t.text_hash, 1) = ANY(%(shards)s))
  AND (%(ids)s::text[] IS NULL OR t.document_id IN (SELECT document_id FROM documents WHERE source_id = ANY(%(ids)s)))
GROUP BY t.text_hash
"""
# The stage finds the missing texts once, into a temp table of this session, and pages through it by hash (a query
# per page over every draft and live chunk made a first ingest quadratic: 0.2 s a page at 10k chunks, 400 pages at
# 100k). Vectors are stored page by page, so an interrupted run loses one page and the next run finds the rest.
TO_EMBED = "CREATE TEMP TABLE kb_to_embed (text_hash text PRIMARY KEY, embed_text text NOT NULL)"
PAGE = "SELECT text_hash, embed_text FROM kb_to_embed WHERE text_hash > %s ORDER BY text_hash LIMIT %s"
SHARDS = tuple("0123456789abcdef")  # the first hex digit of a text hash

# Drafts whose vector is already stored, within the same sources and shards as MISSING: a shard's report counts its
# own shard (16 shards probe the vectors once in all, not 16 times over).
REUSED = """
SELECT count(*) FROM chunk_drafts c
WHERE c.text_hash IS NOT NULL AND EXISTS (SELECT 1 FROM {vectors} v WHERE v.text_hash = c.text_hash)
  AND (%(shards)s::text[] IS NULL OR left(c.text_hash, 1) = ANY(%(shards)s))
  AND (%(ids)s::text[] IS NULL OR c.document_id IN (SELECT document_id FROM documents WHERE source_id = ANY(%(ids)s)))
"""


def embed_pending(conn: psycopg.Connection, embedder: Embedder, source_ids: list[str] | None = None,
                  shards: list[str] | None = None, batch_size: int = 256,
                  progress: Progress = NO_PROGRESS, index: bool = True) -> StageReport:
    """Embed and store what the model lacks. `index`: drop the serving model's HNSW index before a large load and
    build it after (False when the caller does that once around several shards)."""
    report = StageReport("embed", ("computed", "reused", "index_deferred"))
    table, dimensions = _store(conn, embedder, report, source_ids, shards)
    vectors = sql.Identifier(table)
    serving = index and active_model(conn) == embedder.model_key
    conn.execute("DROP TABLE IF EXISTS kb_to_embed")
    conn.execute(TO_EMBED)
    try:
        missing = conn.execute(sql.SQL("INSERT INTO kb_to_embed {}").format(sql.SQL(MISSING).format(vectors=vectors)),
                               {"shards": shards, "ids": source_ids}).rowcount
        progress.total(missing)
        if serving:
            report.counts["index_deferred"] = int(defer_index(conn, table, missing))
        after = ""
        while rows := conn.execute(PAGE, (after, batch_size)).fetchall():
            hashes = [r[0] for r in rows]
            bad = _embed_and_store(conn, embedder, vectors, dimensions, hashes, [r[1] for r in rows])
            _fail_documents(conn, embedder.model_key, bad, report)
            report.counts["computed"] += len(rows) - len(bad)
            after = hashes[-1]
            progress.advance(len(rows))
    finally:  # after a failure inside a caller's transaction the table goes with it, or with the next run's DROP
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
            conn.execute("DROP TABLE IF EXISTS kb_to_embed")
    if serving:
        ensure_index(conn, table)
    return report.finish()


def _store(conn: psycopg.Connection, embedder: Embedder, report: StageReport, source_ids: list[str] | None,
           shards: list[str] | None = None) -> tuple[str, int]:
    """The model's table and dimension; counts the drafts (of these sources and shards) whose vector is already
    stored into the report."""
    table, dimensions = model_store(conn, embedder)
    report.counts["reused"] = conn.execute(sql.SQL(REUSED).format(vectors=sql.Identifier(table)),
                                           {"shards": shards, "ids": source_ids}).fetchone()[0]
    return table, dimensions


def embed_on_dask(conn: psycopg.Connection, settings: Settings, embedders: list[Embedder],
                  source_ids: list[str] | None, address: str, batch_size: int = 256,
                  progress: Progress = NO_PROGRESS) -> StageReport:
    """The embed stage over a dask cluster's workers: the 16 shards of the text-hash space (as the model backfill
    splits its work), a task each, that embeds its shard's missing texts for every model in use and stores the
    vectors itself, so that vectors never travel through this process. Vectors are keyed by text hash and stored
    with ON CONFLICT DO NOTHING: a shard whose worker died runs again on another worker and stores nothing twice;
    a shard lost past allowed-failures fails the stage, and the next run embeds only what is still missing. This
    process only drops the serving index before a large load and builds it after, once. Counters are the first
    (configured) model's; the notes count the shards each worker embedded."""
    report = StageReport("embed", ("computed", "reused", "index_deferred"))
    for other in embedders[1:]:
        model_store(conn, other)  # each model's table exists before 16 tasks would race to create it
    table, _ = _store(conn, embedders[0], report, source_ids)
    missing = conn.execute(sql.SQL("SELECT count(*) FROM ({}) m").format(
        sql.SQL(MISSING).format(vectors=sql.Identifier(table))), {"shards": None, "ids": source_ids}).fetchone()[0]
    progress.total(missing)
    serving = active_model(conn) == embedders[0].model_key
    if serving:
        report.counts["index_deferred"] = int(defer_index(conn, table, missing))
    shipped = replace(settings, database_url=database_url(settings))  # the database this run uses, not a new one
    tasks = [(shipped, [e.model_key for e in embedders], source_ids, shard, batch_size) for shard in SHARDS]
    embedded_by: Counter[str] = Counter()
    for _, worker, result in dask_map(_embed_shard, [(f"embed shard {task[3]}", task) for task in tasks], address):
        if isinstance(result, Lost):
            raise RuntimeError(f"an embed shard was lost: {result.reason}; run the refresh again (it resumes)")
        embedded_by[worker] += 1
        report.counts["computed"] += result["computed"]
        for failure in result["failures"]:
            report.fail(Failure(**failure))
        progress.advance(result["computed"] + len(result["failures"]))
    if serving:
        ensure_index(conn, table)
    report.notes["workers"] = dict(sorted(embedded_by.items()))
    return report.finish()


def _embed_shard(task: tuple) -> dict:
    """A dask task: one shard's missing vectors for every model in use, stored by this worker."""
    settings, model_keys, source_ids, shard, batch_size = task
    with connect(settings) as conn:
        reports = [embed_pending(conn, _model(settings, key), source_ids, [shard], batch_size, index=False)
                   for key in model_keys]
    return {"computed": reports[0].counts["computed"], "failures": [asdict(f) for f in reports[0].failures]}


@cache
def _model(settings: Settings, model_key: str) -> Embedder:
    """One model per worker process and configuration: the shards a worker runs one after another load it once."""
    return embedder_for(model_key, settings)


def model_store(conn: psycopg.Connection, embedder: Embedder) -> tuple[str, int]:
    """The model's vector table and the dimension its vectors must have: the registered one for a known model,
    never asked of the embedder again (an endpoint that answers another length for a run must not change it);
    a new model registers with the embedder's."""
    dimensions = registered_dimensions(conn, embedder.model_key) or embedder.dimensions
    return ensure_vector_store(conn, embedder.model_key, dimensions), dimensions


def missing_by_shard(conn: psycopg.Connection, embedder: Embedder) -> dict[str, int]:
    """{shard: texts still without a vector in this model}, shards with none left out: what a backfill has left."""
    table, _ = model_store(conn, embedder)
    query = sql.SQL("SELECT left(m.text_hash, 1), count(*) FROM ({}) m GROUP BY 1 ORDER BY 1").format(
        sql.SQL(MISSING).format(vectors=sql.Identifier(table)))
    return dict(conn.execute(query, {"shards": None, "ids": None}).fetchall())


def invalid_vectors(vectors: np.ndarray, count: int, dimensions: int) -> dict[int, str]:
    """{row: why} for the vectors that must not be stored: every row when the batch has the wrong shape, else each
    row that is not finite or not of unit length (embedders return L2-normalised vectors; zero stays zero)."""
    vectors = np.asarray(vectors)
    if vectors.ndim == 2 and vectors.shape[0] == count and count and vectors.shape[1] != dimensions:
        return {i: f"the model returned {vectors.shape[1]}-dimensional vectors; this model is registered with"
                   f" {dimensions} (a model's dimension never changes: a new one is a new model)" for i in range(count)}
    if vectors.ndim != 2 or vectors.shape != (count, dimensions):
        return {i: f"the model returned vectors of shape {vectors.shape} for {count} texts of {dimensions} dimensions"
                for i in range(count)}
    bad = {}
    norms = np.linalg.norm(vectors, axis=1)
    for i in range(count):
        if not np.isfinite(vectors[i]).all():
            bad[i] = "the model returned a vector with NaN or infinite values"
        elif abs(norms[i] - 1) > 1e-3:
            bad[i] = "the model returned an all-zero vector" if norms[i] == 0 else f"the model returned a vector of norm {norms[i]:.3g}"
    return bad


def _fail_documents(conn: psycopg.Connection, model_key: str, bad: dict[str, str], report: StageReport) -> None:
    """The documents whose drafts need a refused vector fail for this run: they are not published (their last good
    version stays) and are embedded again by the next run."""
    if not bad:
        return
    rows = conn.execute("SELECT DISTINCT ON (d.document_id) d.source_id, d.locator, d.content_hash, c.text_hash"
                        " FROM chunk_drafts c JOIN documents d USING (document_id) WHERE c.text_hash = ANY(%s)"
                        " ORDER BY d.document_id", (list(bad),)).fetchall()
    with conn.transaction():
        for source_id, locator, content_hash, text_hash in rows:
            failure = Failure(source_id, locator, "embed", f"{locator}: {bad[text_hash]} ({model_key}); not published,"
                                                          " the next run embeds it again")
            report.fail(failure)
            record_failure(conn, failure, content_hash)


def store_vectors(conn: psycopg.Connection, table: sql.Identifier, hashes: list[str], vectors: np.ndarray) -> int:
    """One batch in one transaction: COPY into a temp table, one merge. Idempotent: a vector already stored for
    a text hash is kept (same text, same model, same vector). Returns how many were new."""
    with conn.transaction():
        bulk.stage_rows(conn, "kb_vectors", f"text_hash text, embedding vector({vectors.shape[1]})",
                        ("text_hash", "embedding"), zip(hashes, vectors), types=("text", "vector"))
        return conn.execute(sql.SQL("INSERT INTO {} SELECT * FROM kb_vectors ON CONFLICT (text_hash) DO NOTHING")
                            .format(table)).rowcount


def ensure_vectors(conn: psycopg.Connection, embedder: Embedder, texts: dict[str, str]) -> set[str]:
    """Vectors for these {text hash: text} that the model's table lacks, checked and stored; returns the hashes
    whose vector the model got wrong (not stored)."""
    table, dimensions = model_store(conn, embedder)
    stored = {r[0] for r in conn.execute(sql.SQL("SELECT text_hash FROM {} WHERE text_hash = ANY(%s)")
                                         .format(sql.Identifier(table)), (list(texts),))}
    missing = [h for h in texts if h not in stored]
    if not missing:
        return set()
    return set(_embed_and_store(conn, embedder, sql.Identifier(table), dimensions, missing, [texts[h] for h in missing]))


def _embed_and_store(conn: psycopg.Connection, embedder: Embedder, vectors: sql.Identifier, dimensions: int,
                     hashes: list[str], texts: list[str]) -> dict[str, str]:
    """Embed the texts and store the vectors that pass `invalid_vectors`; returns {hash: why} for the others."""
    computed = embedder.embed(texts)
    bad = invalid_vectors(computed, len(texts), dimensions)
    keep = [i for i in range(len(texts)) if i not in bad]
    if keep:
        store_vectors(conn, vectors, [hashes[i] for i in keep], computed[keep])
    return {hashes[i]: why for i, why in bad.items()}
