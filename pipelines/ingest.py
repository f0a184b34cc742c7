"""The whole ingest, stage after stage, as the CLI runs it (Dagster runs the same stages as assets)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import psycopg

from pipelines.drafts import chunk_pending, enrich_pending
from pipelines.embedders import Embedder, embedder_for
from pipelines.embedding import embed_pending
from pipelines.extract import extract, load_sources
from pipelines.parse import parse_pending
from pipelines.publish import publish_ready
from pipelines.report import StageReport
from pipelines.settings import Settings
from pipelines.vector_store import activate_if_complete, model_tables

# progress(stage, total) -> advance(n); total is None when unknown up front.
ProgressFactory = Callable[[str, int | None], Callable[[int], None]]

EXIT_FILE_FAILURES = 3  # documented in README: the run finished, but some files failed


@dataclass
class IngestSummary:
    stages: list[StageReport] = field(default_factory=list)

    def stage(self, name: str) -> StageReport:
        return next(s for s in self.stages if s.stage == name)

    @property
    def failures(self) -> list:
        return [f for s in self.stages for f in s.failures]

    def counters(self) -> dict:
        ex, em, pu = self.stage("extract").counts, self.stage("embed").counts, self.stage("publish").counts
        return {
            "documents_seen": ex["seen"],
            "documents_new": ex["new"],
            "documents_changed": ex["changed"],
            "documents_unchanged": ex["unchanged"],
            "documents_deleted": ex["deleted"],
            "documents_failed": len({(f.source_id, f.locator) for f in self.failures}),
            "documents_published": pu["documents"],
            "chunks_written": pu["chunks_written"],
            "chunks_inserted": pu["chunks_inserted"],
            "chunks_updated": pu["chunks_updated"],
            "chunks_closed": pu["chunks_closed"],
            "embeddings_computed": em["computed"],
            "embeddings_reused": em["reused"],
            "elapsed_s": {s.stage: s.elapsed_s for s in self.stages},
        }

    def as_dict(self) -> dict:
        return {**self.counters(), "errors": [
            {"source": f.source_id, "file": f.locator, "stage": f.stage, "reason": f.reason} for f in self.failures]}


def _no_progress(stage: str, total: int | None) -> Callable[[int], None]:
    return lambda n: None


def embed_all_models(conn: psycopg.Connection, embedder: Embedder, settings: Settings,
                     source_ids: list[str] | None = None, progress=None) -> StageReport:
    """Embed with the configured model, and, while a model switch is under way, with the serving one too, so that
    new documents are searchable before and after the switch. Counters are the configured model's."""
    batch = settings.embed_batch_size
    report = embed_pending(conn, embedder, source_ids, batch_size=batch, progress=progress)
    for model_key in model_tables(conn):
        if model_key != embedder.model_key:
            embed_pending(conn, embedder_for(model_key, settings), source_ids, batch_size=batch)
    return report


def ingest(conn: psycopg.Connection, embedder: Embedder, settings: Settings, source_ids: list[str] | None = None,
           progress: ProgressFactory = _no_progress) -> IngestSummary:
    """Run every stage over the given sources (all registered sources when None)."""
    summary = IngestSummary()
    run_id = conn.execute("INSERT INTO ingest_runs (sources) VALUES (%s) RETURNING run_id",
                          (source_ids or [s.source_id for s in load_sources(conn)],)).fetchone()[0]
    summary.stages.append(extract(conn, load_sources(conn, source_ids)))
    summary.stages.append(parse_pending(conn, source_ids, progress_for=lambda total: progress("parse", total),
                                        workers=settings.parse_workers))
    summary.stages.append(chunk_pending(conn, embedder.counter, source_ids))
    summary.stages.append(enrich_pending(conn, embedder.counter, source_ids))
    summary.stages.append(embed_all_models(conn, embedder, settings, source_ids, progress("embed", None)))
    summary.stages.append(publish_ready(conn, source_ids, batch_size=settings.batch_documents))
    activate_if_complete(conn, embedder.model_key)
    conn.execute("UPDATE ingest_runs SET finished_at = now(), counters = %s WHERE run_id = %s",
                 (summary.as_dict(), run_id))
    return summary
