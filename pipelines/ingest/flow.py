"""The ingest flow, declared once: each stage's function, the table it fills, its version and its counters.

Everything that runs the flow reads this list: the run (pipelines/ingest/run.py) executes it in order, the CLI
shows its stages, and the Dagster layer (assets/ingestion.py) generates one asset per stage from it, with the
asset's name, description, kinds, code version and row count taken from here. Adding a stage is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from pipelines.ingest.chunker import CHUNKER_VERSION
from pipelines.ingest.enrich import ENRICH_VERSION
from pipelines.ingest.parse import PARSER_VERSION
from pipelines.ingest.report import Progress, StageReport

if TYPE_CHECKING:
    from pipelines.ingest.run import IngestRun


@dataclass(frozen=True)
class Stage:
    name: str  # the stage's name in `ingest_runs`, progress lines and `kb ingest --json`
    asset: str  # the Dagster asset that shows it
    table: str  # the table it fills
    run: Callable[["IngestRun", Progress], StageReport]
    description: str
    unit: str  # what its progress counts
    technologies: tuple[str, ...]  # what it runs on (the asset's kinds in the UI)
    group: str  # "ingestion" (documents to drafts) or "embeddings" (vectors and what serves)
    holds: str  # SQL: the rows it holds for one source (%(id)s), Dagster's dagster/row_count
    version: str | None = None  # a new version makes its stored output stale (the asset's code version)
    gated: bool = False  # the run executes it and the golden-set gate in one transaction


def _extract(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.ingest.extract import extract
    from pipelines.sources.declarations import load_sources

    return extract(run.conn, load_sources(run.conn, run.source_ids), run.settings.limits,
                   run.confirmed.allow_deletions, progress, run.confirmed.accept_new_root,
                   skip_unsupported=run.settings.unsupported_files == "skip")


def _parse(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.ingest.parse import parse_pending

    return parse_pending(run.conn, run.source_ids, progress=progress, workers=run.workers,
                         limits=run.settings.limits, retry_failed=run.confirmed.retry_failed)


def _chunk(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.ingest.chunk import chunk_pending

    return chunk_pending(run.conn, run.embedder.counter, run.source_ids, progress=progress,
                         limits=run.settings.limits, workers=run.workers)


def _enrich(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.ingest.enrich import enrich_pending

    return enrich_pending(run.conn, run.embedder.counter, run.source_ids, progress=progress)


def _embed(run: "IngestRun", progress: Progress) -> StageReport:
    """Embed with the configured model and, while a model switch is under way, with the serving one too, so that
    new documents are searchable before and after the switch; on a dask cluster's workers when the run has one.
    Counters are the configured model's."""
    from pipelines.ingest.embed import embed_on_dask, embed_pending

    configured, *others = run.models_in_use()
    batch, shards = run.settings.embed_batch_size, [run.shard] if run.shard else None
    if run.workers.dask and not shards:
        return embed_on_dask(run.conn, run.settings, [configured, *others], run.source_ids, run.workers.dask, batch,
                             progress)
    report = embed_pending(run.conn, configured, run.source_ids, shards, batch_size=batch, progress=progress)
    for other in others:
        embed_pending(run.conn, other, run.source_ids, shards, batch_size=batch)
    return report


def _publish(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.ingest.publish import publish_ready

    return publish_ready(run.conn, run.source_ids, batch_size=run.settings.batch_documents, progress=progress,
                         model_keys=[model.model_key for model in run.models_in_use()])


def _cards(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.ingest.cards import generate_cards

    return generate_cards(run.conn, run.settings, run.models_in_use(), run.source_ids, progress=progress)


def _calibrate(run: "IngestRun", progress: Progress) -> StageReport:
    from pipelines.answers.calibration import calibration_stage

    published = run.conn.execute("SELECT stages->'publish'->'counts' FROM ingest_runs WHERE run_id = %s",
                                 (run.run_id,)).fetchone()[0] or {}
    return calibration_stage(run.conn, run.settings, changed=bool(published.get("documents") or
                                                                  published.get("deleted")), progress=progress)


_OF_SOURCE = "JOIN documents d USING (document_id) WHERE d.source_id = %(id)s"

FLOW: tuple[Stage, ...] = (
    Stage("extract", "source_documents", "documents", _extract,
          "Documents found in the source, with size, mtime and content hash; vanished ones soft-deleted.",
          "file", ("python", "postgres"), "ingestion",
          "SELECT count(*) FROM documents d WHERE d.source_id = %(id)s AND d.deleted_at IS NULL"),
    Stage("parse", "parsed_elements", "elements", _parse,
          "Elements (category, page, section path) of every document whose bytes or parser version changed, parsed by"
          " unstructured.",
          "doc", ("unstructured", "postgres"), "ingestion",
          f"SELECT count(*) FROM elements e {_OF_SOURCE} AND d.deleted_at IS NULL", version=PARSER_VERSION),
    Stage("chunk", "chunk_drafts", "chunk_drafts", _chunk,
          "Heading-, sentence- and table-aware chunks of changed documents, sized to the embedding model's limit.",
          "doc", ("python", "postgres"), "ingestion",
          f"SELECT count(*) FROM chunk_drafts c {_OF_SOURCE}", version=CHUNKER_VERSION),
    Stage("enrich", "enriched_chunks", "chunk_drafts", _enrich,
          "Drafts with their embedded text (title + section path + text), text hash and extracted entities.",
          "chunk", ("python", "postgres"), "ingestion",
          f"SELECT count(*) FROM chunk_drafts c {_OF_SOURCE} AND c.embed_text IS NOT NULL", version=ENRICH_VERSION),
    Stage("embed", "chunk_embeddings", "vectors_<model>", _embed,
          "Vectors for embedded texts the model has not seen; identical text is never embedded twice.",
          "chunk", ("onnx", "pgvector"), "embeddings",
          f"SELECT count(DISTINCT c.text_hash) FROM chunks c {_OF_SOURCE} AND c.valid_to IS NULL"),
    Stage("publish", "published_chunks", "chunks", _publish,
          "The searchable chunks: each document's new version swapped in atomically, replaced chunks kept as"
          " history; served only if the source's golden set holds.",
          "doc", ("postgres", "pgvector"), "embeddings",
          f"SELECT count(*) FROM chunks c {_OF_SOURCE} AND c.valid_to IS NULL AND c.kind <> 'card'", gated=True),
    Stage("cards", "qa_cards", "chunks", _cards,
          "Question -> answer cards of the new chunks (FAQ rules, and the chat model when one is configured),"
          " cached by text, versioned and searched like chunks.",
          "chunk", ("python", "postgres"), "embeddings",
          f"SELECT count(*) FROM chunks c {_OF_SOURCE} AND c.valid_to IS NULL AND c.kind = 'card'"),
    Stage("calibrate", "answer_calibration", "answer_calibrations", _calibrate,
          "When to answer and when to say the documents do not: a logistic fit of the answer evidence on probes built"
          " from the knowledge base's own chunks, per embedding model, refit when the model or a tenth of the corpus"
          " changes.",
          "probe", ("numpy", "postgres"), "embeddings",
          "SELECT count(*) FROM answer_probes p WHERE p.source_id = %(id)s"),
)
STAGE_NAMES = tuple(stage.name for stage in FLOW)


def stage(name: str) -> Stage:
    return next(s for s in FLOW if s.name == name)
