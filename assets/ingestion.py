"""One asset per ingestion stage, partitioned by declared source. Each reads the previous stage's table and writes
its own, through the same stage runner as `kb ingest` (pipelines/ingest.py).

Every stage of a source runs under that source's advisory lock, so two runs of one source never interleave,
while different sources proceed in parallel.
"""

from contextlib import contextmanager

import dagster as dg

from assets.metadata import report_metadata
from assets.partitions import sources
from assets.resources import KnowledgeBase
from pipelines.chunking import CHUNKER_VERSION
from pipelines.enrich import ENRICH_VERSION

INGESTION = "ingestion"
EMBEDDINGS = "embeddings"


class CrawlConfig(dg.Config):
    """Run config of source_documents: set allow_deletions to confirm that documents really are gone when a crawl
    would soft-delete more than the source's max_deletion_share (without it, such a crawl deletes none)."""

    allow_deletions: bool = False


@contextmanager
def ingest_run(kb: KnowledgeBase, context: dg.AssetExecutionContext, allow_deletions: bool = False):
    """The partition's source under its advisory lock, as one `ingest_runs` row per Dagster run: the same runner,
    records and side effects as `kb ingest`."""
    from pipelines.ingest import IngestRun
    from pipelines.locks import source_locks
    from pipelines.sources import get_source

    source_id = context.partition_key
    with kb.connect() as conn, source_locks(conn, [source_id]):
        if get_source(conn, source_id) is None:
            raise dg.Failure(f"source {source_id!r} is not declared (see `kb source list`); its partition is left"
                             " over and the source_partitions sensor will remove it")
        yield IngestRun.start(conn, kb.settings, kb.embedder, [source_id], started_by="dagster",
                              external_run_id=context.run_id, allow_deletions=allow_deletions)


def run_stage(context: dg.AssetExecutionContext, kb: KnowledgeBase, stage: str, row_count_key: str,
              allow_deletions: bool = False) -> dg.MaterializeResult:
    with ingest_run(kb, context, allow_deletions) as run:
        report = run.run_stage(stage)
    for failure in report.failures:
        context.log.warning(str(failure))
    return dg.MaterializeResult(metadata=report_metadata(report, row_count_key))


@dg.asset(partitions_def=sources, group_name=INGESTION, kinds={"python", "postgres"})
def source_documents(context: dg.AssetExecutionContext, kb: KnowledgeBase, config: CrawlConfig) -> dg.MaterializeResult:
    """Documents found in the source, with size, mtime and content hash; vanished ones soft-deleted."""
    return run_stage(context, kb, "extract", "seen", config.allow_deletions)


@dg.asset(deps=[source_documents], partitions_def=sources, group_name=INGESTION, kinds={"unstructured", "postgres"},
          retry_policy=dg.RetryPolicy(max_retries=1))
def parsed_elements(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Elements (category, page, section path) of every document whose bytes changed, parsed by unstructured."""
    return run_stage(context, kb, "parse", "elements")


@dg.asset(deps=[parsed_elements], partitions_def=sources, group_name=INGESTION, kinds={"python", "postgres"},
          code_version=CHUNKER_VERSION)
def chunk_drafts(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Heading-, sentence- and table-aware chunks of changed documents, sized to the embedding model's limit."""
    return run_stage(context, kb, "chunk", "chunks")


@dg.asset(deps=[chunk_drafts], partitions_def=sources, group_name=INGESTION, kinds={"python", "postgres"},
          code_version=ENRICH_VERSION)
def enriched_chunks(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Drafts with their embedded text (title + section path + text), text hash and extracted entities."""
    return run_stage(context, kb, "enrich", "chunks")


@dg.asset(deps=[enriched_chunks], partitions_def=sources, group_name=EMBEDDINGS, kinds={"pytorch", "pgvector"},
          pool="embedding_model", retry_policy=dg.RetryPolicy(max_retries=2, delay=10))
def chunk_embeddings(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Vectors for embedded texts the model has not seen; identical text is never embedded twice."""
    result = run_stage(context, kb, "embed", "computed")
    result.metadata["model"] = dg.MetadataValue.text(kb.embedder.model_key)
    return result


@dg.asset(deps=[chunk_embeddings], partitions_def=sources, group_name=EMBEDDINGS, kinds={"postgres", "pgvector"})
def published_chunks(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """The searchable chunks: each document's new version swapped in atomically, replaced chunks kept as history."""
    return run_stage(context, kb, "publish", "chunks_written")


@dg.asset(deps=[published_chunks], partitions_def=sources, group_name=EMBEDDINGS, kinds={"openai", "postgres"},
          pool="embedding_model", retry_policy=dg.RetryPolicy(max_retries=2, delay=10))
def qa_cards(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Question -> answer cards of the new chunks (FAQ rules, and the chat model when KB_CHAT_MODEL is set),
    cached by text, versioned and searched like chunks."""
    return run_stage(context, kb, "cards", "cards")


@dg.asset_check(asset=published_chunks, blocking=True)
def every_live_chunk_is_searchable(kb: KnowledgeBase) -> dg.AssetCheckResult:
    """Each live chunk fits the model's input and has a vector for the current model."""
    from pipelines.checks import unsearchable_chunks

    with kb.connect() as conn:
        problems = unsearchable_chunks(conn, kb.embedder)
    return dg.AssetCheckResult(passed=not any(problems.values()),
                               metadata={k: dg.MetadataValue.int(v) for k, v in problems.items()})


@dg.asset_check(asset=published_chunks, blocking=True)
def golden_set_hit_rate(kb: KnowledgeBase) -> dg.AssetCheckResult:
    """hit@5 of the golden queries (KB_GOLDEN_SET) stays at or above KB_GOLDEN_FLOOR."""
    from pipelines.golden import golden_hit_rate

    with kb.connect() as conn:
        result = golden_hit_rate(conn, kb.settings, kb.settings.golden_set)
    return dg.AssetCheckResult(
        passed=result["hit_rate"] >= kb.settings.golden_floor,
        metadata={"hit@5": dg.MetadataValue.float(result["hit_rate"]), "queries": result["queries"],
                  "floor": dg.MetadataValue.float(kb.settings.golden_floor),
                  "misses": dg.MetadataValue.md("\n".join(f"- {m['query']} -> {m['document']}" for m in result["misses"]) or "none")})


ASSETS = [source_documents, parsed_elements, chunk_drafts, enriched_chunks, chunk_embeddings, published_chunks, qa_cards]
CHECKS = [every_live_chunk_is_searchable, golden_set_hit_rate]
