"""One asset per ingestion stage, partitioned by declared source. Each reads the previous stage's table and writes
its own, through the same stage runner as `kb ingest` (pipelines/ingest.py).

Every stage of a source runs under that source's advisory lock, so two runs of one source never interleave,
while different sources proceed in parallel. `published_chunks` checks the golden set inside its publishing
transaction: a refresh below the floor is rolled back and the previous version keeps serving.
"""

from contextlib import contextmanager

import dagster as dg

from assets.executors import model_pool
from assets.metadata import report_metadata, statistics_metadata
from assets.partitions import sources
from assets.resources import KnowledgeBase
from pipelines.ingest.chunker import CHUNKER_VERSION
from pipelines.ingest.enrich import ENRICH_VERSION

INGESTION, EMBEDDINGS = "ingestion", "embeddings"
OWNERS = ["team:search-platform"]


def table(name: str) -> dict:
    return {"dagster/table_name": f"kb.public.{name}"}


class CrawlConfig(dg.Config):
    """Run config of source_documents: set allow_deletions to confirm that documents really are gone when a crawl
    would soft-delete more than the source's max_deletion_share (without it, such a crawl deletes none)."""

    allow_deletions: bool = False


@contextmanager
def ingest_run(kb: KnowledgeBase, context: dg.AssetExecutionContext, allow_deletions: bool = False):
    """The partition's source under its advisory lock, as one `ingest_runs` row per Dagster run: the same runner,
    records and side effects as `kb ingest`."""
    from pipelines.ingest.run import IngestRun
    from pipelines.sources.declarations import get_source
    from pipelines.storage.locks import source_locks

    source_id = context.partition_key
    with kb.connect() as conn, source_locks(conn, [source_id]):
        if get_source(conn, source_id) is None:
            raise dg.Failure(f"source {source_id!r} is not declared (see `kb source list`); its partition is left"
                             " over and the source_partitions sensor will remove it")
        yield IngestRun.start(conn, kb.settings, kb.embedder, [source_id], started_by="dagster",
                              external_run_id=context.run_id, allow_deletions=allow_deletions)


def run_stage(context: dg.AssetExecutionContext, kb: KnowledgeBase, stage: str, asset: str,
              allow_deletions: bool = False):
    """(the stage's report, its metadata): counters, time, failures, and the rows the asset now holds."""
    from pipelines.storage.status import holdings

    with ingest_run(kb, context, allow_deletions) as run:
        report = run.run_stage(stage)
        held = holdings(run.conn, context.partition_key, asset)
    for failure in report.failures:
        context.log.warning(str(failure))
    return report, {**report_metadata(report), "dagster/row_count": dg.MetadataValue.int(held)}


@dg.asset(partitions_def=sources, group_name=INGESTION, kinds={"python", "postgres"}, owners=OWNERS,
          tags={"stage": "extract"}, metadata=table("documents"))
def source_documents(context: dg.AssetExecutionContext, kb: KnowledgeBase, config: CrawlConfig) -> dg.MaterializeResult:
    """Documents found in the source, with size, mtime and content hash; vanished ones soft-deleted."""
    _, metadata = run_stage(context, kb, "extract", "source_documents", config.allow_deletions)
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(deps=[source_documents], partitions_def=sources, group_name=INGESTION, kinds={"unstructured", "postgres"},
          owners=OWNERS, tags={"stage": "parse"}, metadata=table("elements"), retry_policy=dg.RetryPolicy(max_retries=1))
def parsed_elements(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Elements (category, page, section path) of every document whose bytes changed, parsed by unstructured."""
    _, metadata = run_stage(context, kb, "parse", "parsed_elements")
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(deps=[parsed_elements], partitions_def=sources, group_name=INGESTION, kinds={"python", "postgres"},
          owners=OWNERS, tags={"stage": "chunk"}, metadata=table("chunk_drafts"), code_version=CHUNKER_VERSION)
def chunk_drafts(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Heading-, sentence- and table-aware chunks of changed documents, sized to the embedding model's limit."""
    _, metadata = run_stage(context, kb, "chunk", "chunk_drafts")
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(deps=[chunk_drafts], partitions_def=sources, group_name=INGESTION, kinds={"python", "postgres"},
          owners=OWNERS, tags={"stage": "enrich"}, metadata=table("chunk_drafts"), code_version=ENRICH_VERSION)
def enriched_chunks(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Drafts with their embedded text (title + section path + text), text hash and extracted entities."""
    _, metadata = run_stage(context, kb, "enrich", "enriched_chunks")
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(deps=[enriched_chunks], partitions_def=sources, group_name=EMBEDDINGS, kinds={"onnx", "pgvector"},
          owners=OWNERS, tags={"stage": "embed"}, pool=model_pool(),
          retry_policy=dg.RetryPolicy(max_retries=2, delay=10))
def chunk_embeddings(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Vectors for embedded texts the model has not seen; identical text is never embedded twice."""
    _, metadata = run_stage(context, kb, "embed", "chunk_embeddings")
    return dg.MaterializeResult(metadata={**metadata, "model": dg.MetadataValue.text(kb.embedder.model_key)})


GOLDEN = dg.AssetCheckSpec("golden_set_hit_rate", asset="published_chunks", blocking=True,
                           description="hit@5 of the golden queries (KB_GOLDEN_SET) about this source, checked inside"
                                       " the publishing transaction: below KB_GOLDEN_FLOOR the refresh is rolled back")


@dg.asset(deps=[chunk_embeddings], partitions_def=sources, group_name=EMBEDDINGS, kinds={"postgres", "pgvector"},
          owners=OWNERS, tags={"stage": "publish"}, metadata=table("chunks"), check_specs=[GOLDEN])
def published_chunks(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """The searchable chunks: each document's new version swapped in atomically, replaced chunks kept as history;
    served only if the golden set holds."""
    from pipelines.ingest.golden import GateFailed
    from pipelines.storage.status import ingest_statistics

    try:
        report, metadata = run_stage(context, kb, "publish", "published_chunks")
    except GateFailed as failed:
        raise dg.Failure(description=str(failed), metadata=_gate_metadata(failed.gate)) from None
    gate = report.notes.get("gate")
    with kb.connect() as conn:
        statistics = ingest_statistics(conn, [context.partition_key])
    return dg.MaterializeResult(metadata={**metadata, **statistics_metadata(statistics)},
                                check_results=[_gate_result(gate, kb.settings.golden_floor)])


def _gate_result(gate: dict | None, floor: float) -> dg.AssetCheckResult:
    if gate is None:
        return dg.AssetCheckResult(check_name=GOLDEN.name, passed=True, description="nothing was published:"
                                   " the serving version did not change", metadata={"floor": floor})
    if not gate["applicable"]:
        return dg.AssetCheckResult(check_name=GOLDEN.name, passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description="no golden query is about this source: nothing was checked",
                                   metadata=_gate_metadata(gate))
    return dg.AssetCheckResult(check_name=GOLDEN.name, passed=True, metadata=_gate_metadata(gate))


def _gate_metadata(gate: dict) -> dict:
    return {"hit@5": dg.MetadataValue.float(gate["hit_rate"] if gate["hit_rate"] is not None else float("nan")),
            "queries": dg.MetadataValue.int(gate["queries"]), "floor": dg.MetadataValue.float(gate["floor"]),
            "misses": dg.MetadataValue.md("\n".join(f"- {m['query']} -> {m['document']}" for m in gate["misses"])
                                          or "none")}


@dg.asset(deps=[published_chunks], partitions_def=sources, group_name=EMBEDDINGS, kinds={"openai", "postgres"},
          owners=OWNERS, tags={"stage": "cards"}, metadata=table("chunks"), pool=model_pool(),
          retry_policy=dg.RetryPolicy(max_retries=2, delay=10))
def qa_cards(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Question -> answer cards of the new chunks (FAQ rules, and the chat model when KB_CHAT_MODEL is set),
    cached by text, versioned and searched like chunks."""
    _, metadata = run_stage(context, kb, "cards", "qa_cards")
    return dg.MaterializeResult(metadata=metadata)


@dg.asset_check(asset=published_chunks, blocking=True)
def every_live_chunk_is_searchable(kb: KnowledgeBase) -> dg.AssetCheckResult:
    """Each live chunk fits the model's input and has a vector for the current model."""
    from pipelines.ingest.checks import unsearchable_chunks

    with kb.connect() as conn:
        problems = unsearchable_chunks(conn, kb.embedder)
    return dg.AssetCheckResult(passed=not any(problems.values()),
                               metadata={k: dg.MetadataValue.int(v) for k, v in problems.items()})


ASSETS = [source_documents, parsed_elements, chunk_drafts, enriched_chunks, chunk_embeddings, published_chunks, qa_cards]
CHECKS = [every_live_chunk_is_searchable]
