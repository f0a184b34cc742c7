"""The ingest run: the flow's stages (pipelines/ingest/flow.py) over some sources, with the same records and side
effects whichever entry point starts it: `kb ingest`, `kb eval`, a Dagster materialization, a schedule or a
backfill.

The run, not its caller, owns what makes a refresh safe:
- the sources' advisory locks, held from the run's first stage to its finish, so two runs of one source never
  interleave between stages, whatever started them;
- the transaction boundaries: each stage commits its own batches, and the gated stage (publish) runs with the
  golden-set gate in one transaction, so a refresh below its floor is rolled back and the previous version serves;
- the finish, however the run ends (every stage, a subset, a gate that stopped it, an error): the run's counters
  and outcome in `ingest_runs`. A run never switches the serving model: a configured model that is not the
  serving one is built beside it, and an operator switches (the `active_model` asset, `kb dagster reembed`).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import psycopg
from psycopg.types.json import Jsonb

from pipelines.ingest.flow import FLOW, STAGE_NAMES, Stage
from pipelines.ingest.golden import GateFailed, golden_gate
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.ingest.workers import Workers
from pipelines.models.embedders import Embedder, embedder_for
from pipelines.settings import Settings
from pipelines.sources.declarations import changed_since_applied, load_sources
from pipelines.storage.locks import source_locks
from pipelines.storage.statistics import analyze_if_stale
from pipelines.storage.vectors import active_model, model_tables

# progress(stage) -> what that stage reports to while it runs (pipelines/ingest/report.Progress)
ProgressFactory = Callable[[str], Progress]

EXIT_FILE_FAILURES = 3  # documented in README: the run finished, but some files failed
EXIT_GATE_FAILED = 4  # the golden-set gate stopped the refresh: nothing of it was published
SHARD_MARK = ":"  # a stage's report of one shard is recorded as "embed:3"


@dataclass
class IngestSummary:
    stages: list[StageReport] = field(default_factory=list)

    def stage(self, name: str) -> StageReport:
        return next(s for s in self.stages if s.stage == name)

    def _counts(self, name: str) -> dict:
        return next((s.counts for s in self.stages if s.stage == name), {})

    @property
    def failures(self) -> list:
        return [f for s in self.stages for f in s.failures]

    def counters(self) -> dict:
        """The run's counters; a stage that did not run (a subset run) counts zero."""
        ex, em, pu = self._counts("extract"), self._counts("embed"), self._counts("publish")
        return {
            "documents_seen": ex.get("seen", 0),
            "documents_new": ex.get("new", 0),
            "documents_changed": ex.get("changed", 0),
            "documents_unchanged": ex.get("unchanged", 0),
            "documents_fetched": ex.get("fetched", 0),  # objects downloaded from a store: new or with a new tag
            "documents_deleted": pu.get("deleted", 0),
            "documents_skipped": ex.get("skipped", 0),
            "documents_failed": len({(f.source_id, f.locator) for f in self.failures}),
            "documents_published": pu.get("documents", 0),
            "chunks_written": pu.get("chunks_written", 0),
            "chunks_inserted": pu.get("chunks_inserted", 0),
            "chunks_updated": pu.get("chunks_updated", 0),
            "chunks_closed": pu.get("chunks_closed", 0),
            "embeddings_computed": em.get("computed", 0),
            "embeddings_reused": em.get("reused", 0),
            "cards_written": self._counts("cards").get("cards", 0),
            "elapsed_s": {s.stage: s.elapsed_s for s in self.stages},
        }

    def as_dict(self) -> dict:
        return {**self.counters(), "errors": [
            {"source": f.source_id, "file": f.locator, "stage": f.stage, "reason": f.reason} for f in self.failures],
                "skipped": [{"source": f.source_id, "file": f.locator, "reason": f.reason}
                            for s in self.stages for f in s.skipped],
                "sources": next((s.notes.get("sources", {}) for s in self.stages if s.stage == "extract"), {})}


def _no_progress(stage: str) -> Progress:
    return NO_PROGRESS


@dataclass(frozen=True)
class Confirmations:
    """What the operator confirmed for this run (`kb ingest` flags, Dagster run config)."""

    allow_deletions: bool = False  # documents really are gone: a crawl may delete more than max_deletion_share
    accept_new_root: bool = False  # the source's root really is a new folder: record it and crawl it
    retry_failed: bool = False  # parse again files whose unchanged bytes failed before


class IngestRun:
    """One run of the flow over some sources, recorded in `ingest_runs`. Open it with `IngestRun.open`."""

    def __init__(self, conn: psycopg.Connection, settings: Settings, embedder: Embedder, source_ids: list[str],
                 run_id: int, progress: ProgressFactory, confirmed: "Confirmations", workers: Workers,
                 shard: str | None = None):
        self.conn, self.settings, self.embedder = conn, settings, embedder
        self.source_ids, self.run_id, self.progress = source_ids, run_id, progress
        self.confirmed, self.workers, self.shard = confirmed, workers, shard
        # What whoever started the run should know before reading its outcome (a kb.toml edited but not applied).
        self.warnings = changed_since_applied(conn, source_ids)

    @classmethod
    @contextmanager
    def open(cls, conn: psycopg.Connection, settings: Settings, embedder: Embedder,
             source_ids: list[str] | None = None, *, started_by: str = "cli", external_run_id: str | None = None,
             progress: ProgressFactory = _no_progress, confirmed: "Confirmations | None" = None,
             workers: Workers | None = None, shard: str | None = None) -> Iterator["IngestRun"]:
        """A run over these sources (every declared source when None), holding their locks until it has finished.
        A run of an orchestrator (one Dagster run id) is one row, however many times it is opened. `workers` parse
        the documents (default: KB_PARSE_WORKERS local processes); the run's own process keeps the lock and stores
        what they return. `shard` (a hex digit) narrows the run to the texts whose hash starts with it: a model
        backfill is such runs, one per shard, side by side under shared locks (they only add vectors), recorded on
        one row with a report per shard."""
        ids = sorted(source_ids or [s.source_id for s in load_sources(conn)])
        with source_locks(conn, ids, shared=shard is not None):
            run_id = conn.execute(
                "INSERT INTO ingest_runs (sources, started_by, external_run_id) VALUES (%s, %s, %s)"
                " ON CONFLICT (external_run_id) DO UPDATE SET sources = coalesce(("
                "   SELECT array_agg(DISTINCT s) FROM unnest(ingest_runs.sources || excluded.sources) s), '{}'),"
                "   finished_at = NULL"
                " RETURNING run_id", (ids, started_by, external_run_id)).fetchone()[0]
            run = cls(conn, settings, embedder, ids, run_id, progress, confirmed or Confirmations(),
                      workers or Workers(settings.parse_workers), shard)
            try:
                yield run
            except BaseException as exc:
                if not (conn.closed or conn.broken):  # a lost database cannot record; the next run resumes
                    run._finish(outcome=_outcome(exc))
                raise
            run._finish(outcome="succeeded")

    def run_stage(self, stage: Stage) -> StageReport:
        """Run one stage and record its report. The gated stage runs with the golden-set gate in one transaction:
        a gate below its floor rolls it back, is recorded with the gate's result, and is raised as GateFailed. Once
        it commits, the tables it filled are analyzed if it wrote a large share of them (storage/statistics.py); its
        time counts the gate and that."""
        progress = self.progress(stage.name)
        try:
            if stage.gated:
                with self.conn.transaction():
                    report = stage.run(self, progress)
                    self._gate(report)
                tables = model_tables(self.conn)
                if analyzed := analyze_if_stale(self.conn, report.counts["chunks_written"],
                                                tuple(tables[m.model_key] for m in self.models_in_use()
                                                      if m.model_key in tables)):
                    report.notes["analyzed"] = analyzed
                report.finish()
            else:
                report = stage.run(self, progress)
        except GateFailed as failed:
            report = StageReport(stage.name)
            report.notes = {"gate": failed.gate, "published": False}
            self._record(stage.name, report)
            raise
        progress.done(report)
        self._record(stage.name, report)
        return report

    def run_all(self) -> "IngestSummary":
        for stage in FLOW:
            self.run_stage(stage)
        return self.summary()

    def _gate(self, report: StageReport) -> None:
        """The golden sets of the run's sources, checked on what the stage just published (inside its transaction:
        search here sees the new version, readers elsewhere the old one)."""
        if not report.counts["documents"] and not report.counts["deleted"]:
            return  # nothing was published or deleted: what serves has not changed
        gate = golden_gate(self.conn, self.settings, self.source_ids)
        report.notes["gate"] = gate
        if gate["applicable"] and not gate["passed"]:
            raise GateFailed(gate)

    def _record(self, stage: str, report: StageReport) -> None:
        key = f"{stage}{SHARD_MARK}{self.shard}" if self.shard else stage
        self.conn.execute("UPDATE ingest_runs SET stages = stages || jsonb_build_object(%s::text, %s::jsonb)"
                          " WHERE run_id = %s", (key, Jsonb(report.as_dict()), self.run_id))

    def summary(self) -> IngestSummary:
        """The run's stages as recorded."""
        return stored_summary(
            self.conn.execute("SELECT stages FROM ingest_runs WHERE run_id = %s", (self.run_id,)).fetchone()[0])

    def models_in_use(self) -> list[Embedder]:
        """The configured model first, then the serving one when it is another (during a switch). A model being
        built that is neither (left by a configuration one run or shell once had) is not embedded by refreshes:
        its backfill fills it when an operator builds it, and it can never make a plain refresh fail."""
        serving = active_model(self.conn)
        return [self.embedder] + ([embedder_for(serving, self.settings)]
                                  if serving not in (None, self.embedder.model_key) else [])

    def _finish(self, outcome: str) -> None:
        """Record the counters of what ran. No model switch here: what one run embedded (an endpoint that answered
        another dimension, a configuration changed for a run) must never change which model serves. The shards of a
        run (a backfill's) finish one by one on one row: each records its own outcome, and the run's is the first
        that did not succeed (SQL merges them, so two shards finishing at once lose neither)."""
        if not self.shard:
            self.conn.execute("UPDATE ingest_runs SET finished_at = now(), counters = %s WHERE run_id = %s",
                              (Jsonb({**self.summary().as_dict(), "outcome": outcome}), self.run_id))
            return
        self.conn.execute(
            "UPDATE ingest_runs SET finished_at = now(), counters = %(summary)s || jsonb_build_object('shards',"
            " coalesce(counters -> 'shards', '{}') || jsonb_build_object(%(shard)s::text, %(outcome)s::text))"
            " WHERE run_id = %(run)s", {"summary": Jsonb(self.summary().as_dict()), "shard": self.shard,
                                       "outcome": outcome, "run": self.run_id})
        self.conn.execute(
            "UPDATE ingest_runs SET counters = counters || jsonb_build_object('outcome', coalesce((SELECT value FROM"
            " jsonb_each_text(counters -> 'shards') WHERE value <> 'succeeded' ORDER BY key LIMIT 1), 'succeeded'))"
            " WHERE run_id = %s", (self.run_id,))


def stored_summary(stages: dict) -> IngestSummary:
    """A run's summary from its `ingest_runs.stages`: a stage run in shards (a backfill) counts as one, its shards
    summed."""
    return IngestSummary([StageReport.merged(name, [StageReport.from_dict(name, data) for key, data in
                                                    sorted(stages.items()) if key.split(SHARD_MARK)[0] == name])
                          for name in STAGE_NAMES if any(key.split(SHARD_MARK)[0] == name for key in stages)])


GATE_STOPPED = "stopped by the golden-set gate"  # a run's outcome when the gate rolled its publish back


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, GateFailed):
        return GATE_STOPPED
    return f"failed: {type(exc).__name__}: {exc}"[:500]


def ingest(conn: psycopg.Connection, embedder: Embedder, settings: Settings, source_ids: list[str] | None = None,
           progress: ProgressFactory = _no_progress, confirmed: Confirmations | None = None,
           started_by: str = "cli", workers: Workers | None = None) -> IngestSummary:
    """Run every stage over the given sources (all declared sources when None), as `kb ingest` does."""
    with IngestRun.open(conn, settings, embedder, source_ids, started_by=started_by, progress=progress,
                        confirmed=confirmed, workers=workers) as run:
        return run.run_all()
