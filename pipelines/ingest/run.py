"""The ingest run: every stage in order over some sources, with the same records and side effects whether
`kb ingest` or a Dagster materialization runs it.

A run is a row in `ingest_runs`. Each stage writes its report there as it finishes, so a run whose stages are
Dagster assets in separate processes adds up to the same counters as one `kb ingest`, and `kb status` shows the
last run whichever entry point started it. The last stage (cards, after publish) finishes the run: it switches search
to a fully embedded new model and records the run's counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import psycopg
from psycopg.types.json import Jsonb

from pipelines.ingest.cards import generate_cards
from pipelines.ingest.chunk import chunk_pending
from pipelines.ingest.embed import embed_pending
from pipelines.ingest.enrich import enrich_pending
from pipelines.ingest.extract import extract
from pipelines.ingest.golden import GateFailed, golden_gate
from pipelines.ingest.parse import parse_pending
from pipelines.ingest.publish import publish_ready
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.models.embedders import Embedder, embedder_for
from pipelines.settings import Settings
from pipelines.sources.declarations import load_sources
from pipelines.storage.vectors import activate_if_complete, model_tables

# progress(stage) -> what that stage reports to while it runs (pipelines/report.Progress)
ProgressFactory = Callable[[str], Progress]

EXIT_FILE_FAILURES = 3  # documented in README: the run finished, but some files failed
EXIT_GATE_FAILED = 4  # the golden-set gate stopped the refresh: nothing of it was published
STAGES = ("extract", "parse", "chunk", "enrich", "embed", "publish", "cards")


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
            "cards_written": self.stage("cards").counts["cards"],
            "elapsed_s": {s.stage: s.elapsed_s for s in self.stages},
        }

    def as_dict(self) -> dict:
        return {**self.counters(), "errors": [
            {"source": f.source_id, "file": f.locator, "stage": f.stage, "reason": f.reason} for f in self.failures]}


def _no_progress(stage: str) -> Progress:
    return NO_PROGRESS


def models_in_use(conn: psycopg.Connection, embedder: Embedder, settings: Settings) -> list[Embedder]:
    """The configured model first, then every other model with vectors (the serving one during a switch)."""
    return [embedder] + [embedder_for(key, settings) for key in model_tables(conn) if key != embedder.model_key]


def embed_all_models(conn: psycopg.Connection, embedder: Embedder, settings: Settings,
                     source_ids: list[str] | None = None, progress: Progress = NO_PROGRESS) -> StageReport:
    """Embed with the configured model, and, while a model switch is under way, with the serving one too, so that
    new documents are searchable before and after the switch. Counters are the configured model's."""
    batch = settings.embed_batch_size
    configured, *others = models_in_use(conn, embedder, settings)
    report = embed_pending(conn, configured, source_ids, batch_size=batch, progress=progress)
    for other in others:
        embed_pending(conn, other, source_ids, batch_size=batch)
    return report


class IngestRun:
    """One run of the stages over some sources, recorded in `ingest_runs`."""

    def __init__(self, conn: psycopg.Connection, settings: Settings, embedder: Embedder, source_ids: list[str],
                 run_id: int, progress: ProgressFactory = _no_progress, allow_deletions: bool = False):
        self.conn, self.settings, self.embedder = conn, settings, embedder
        self.source_ids, self.run_id, self.progress = source_ids, run_id, progress
        self.allow_deletions = allow_deletions  # confirmed: a crawl may delete more than max_deletion_share

    @classmethod
    def start(cls, conn: psycopg.Connection, settings: Settings, embedder: Embedder,
              source_ids: list[str] | None = None, started_by: str = "cli", external_run_id: str | None = None,
              progress: ProgressFactory = _no_progress, allow_deletions: bool = False) -> "IngestRun":
        """A new run, or the run already recorded for an orchestrator's run id (one row per Dagster run)."""
        ids = source_ids or [s.source_id for s in load_sources(conn)]
        run_id = conn.execute(
            "INSERT INTO ingest_runs (sources, started_by, external_run_id) VALUES (%s, %s, %s)"
            " ON CONFLICT (external_run_id) DO UPDATE SET sources = ("
            "   SELECT array_agg(DISTINCT s) FROM unnest(ingest_runs.sources || excluded.sources) s)"
            " RETURNING run_id", (ids, started_by, external_run_id)).fetchone()[0]
        return cls(conn, settings, embedder, ids, run_id, progress, allow_deletions)

    def run_stage(self, stage: str) -> StageReport:
        """Run one stage and record its report; the last stage also finishes the run. A refresh the golden-set
        gate stops is recorded (with the gate's result) and raised as GateFailed."""
        progress = self.progress(stage)
        try:
            report = getattr(self, f"_{stage}")(progress)
        except GateFailed as failed:
            report = StageReport(stage)
            report.notes = {"gate": failed.gate, "published": False}
            self._record(stage, report)
            raise
        progress.done(report)
        self._record(stage, report)
        if stage == STAGES[-1]:
            self.finish()
        return report

    def _record(self, stage: str, report: StageReport) -> None:
        self.conn.execute("UPDATE ingest_runs SET stages = stages || jsonb_build_object(%s::text, %s::jsonb)"
                          " WHERE run_id = %s", (stage, Jsonb(report.as_dict()), self.run_id))

    def run_all(self) -> IngestSummary:
        for stage in STAGES:
            self.run_stage(stage)
        return self.summary()

    def summary(self) -> IngestSummary:
        stored = self.conn.execute("SELECT stages FROM ingest_runs WHERE run_id = %s", (self.run_id,)).fetchone()[0]
        return IngestSummary([StageReport.from_dict(stage, stored[stage]) for stage in STAGES if stage in stored])

    def finish(self) -> None:
        activate_if_complete(self.conn, self.embedder.model_key)
        counters = self.summary().as_dict() if self._complete() else {}
        self.conn.execute("UPDATE ingest_runs SET finished_at = now(), counters = %s WHERE run_id = %s",
                          (Jsonb(counters), self.run_id))

    def _complete(self) -> bool:
        stored = self.conn.execute("SELECT stages FROM ingest_runs WHERE run_id = %s", (self.run_id,)).fetchone()[0]
        return all(stage in stored for stage in STAGES)

    def _extract(self, progress: Progress) -> StageReport:
        return extract(self.conn, load_sources(self.conn, self.source_ids), self.settings.limits, self.allow_deletions,
                       progress)

    def _parse(self, progress: Progress) -> StageReport:
        return parse_pending(self.conn, self.source_ids, progress=progress, workers=self.settings.parse_workers,
                             limits=self.settings.limits)

    def _chunk(self, progress: Progress) -> StageReport:
        return chunk_pending(self.conn, self.embedder.counter, self.source_ids, progress=progress,
                             max_chunks=self.settings.limits.max_chunks_per_document)

    def _enrich(self, progress: Progress) -> StageReport:
        return enrich_pending(self.conn, self.embedder.counter, self.source_ids, progress=progress)

    def _embed(self, progress: Progress) -> StageReport:
        return embed_all_models(self.conn, self.embedder, self.settings, self.source_ids, progress)

    def _publish(self, progress: Progress) -> StageReport:
        """Publish in one transaction and check the golden set inside it: search there sees the new version, readers
        outside the old one, and a gate below its floor rolls the refresh back."""
        with self.conn.transaction():
            report = publish_ready(self.conn, self.source_ids, batch_size=self.settings.batch_documents,
                                   progress=progress)
            if report.counts["documents"]:
                gate = golden_gate(self.conn, self.settings, self.source_ids)
                report.notes["gate"] = gate
                if gate["applicable"] and not gate["passed"]:
                    raise GateFailed(gate)
        return report

    def _cards(self, progress: Progress) -> StageReport:
        return generate_cards(self.conn, self.settings, models_in_use(self.conn, self.embedder, self.settings),
                              self.source_ids, progress=progress)


def ingest(conn: psycopg.Connection, embedder: Embedder, settings: Settings, source_ids: list[str] | None = None,
           progress: ProgressFactory = _no_progress, allow_deletions: bool = False) -> IngestSummary:
    """Run every stage over the given sources (all declared sources when None), as `kb ingest` does."""
    return IngestRun.start(conn, settings, embedder, source_ids, progress=progress,
                           allow_deletions=allow_deletions).run_all()
