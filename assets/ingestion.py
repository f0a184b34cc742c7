"""One asset per ingestion stage. Each reads the previous stage's table and writes its own."""

import dagster as dg

from assets.metadata import report_metadata
from assets.resources import KnowledgeBase
from pipelines.chunking import CHUNKER_VERSION
from pipelines.enrich import ENRICH_VERSION

INGESTION = "ingestion"
EMBEDDINGS = "embeddings"


@dg.asset(group_name=INGESTION, kinds={"python", "postgres"}, pool="postgres")
def source_documents(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Documents found in the configured sources, with size, mtime and content hash; vanished ones soft-deleted."""
    from pipelines.extract import extract, load_sources, register_source, source_for_path

    with kb.connect() as conn:
        for name, path in kb.settings.sources.items():
            register_source(conn, source_for_path(path, name))
        report = extract(conn, load_sources(conn))
    for failure in report.failures:
        context.log.warning(str(failure))
    return dg.MaterializeResult(metadata=report_metadata(report, "seen"))


@dg.asset(deps=[source_documents], group_name=INGESTION, kinds={"unstructured", "postgres"}, pool="postgres",
          retry_policy=dg.RetryPolicy(max_retries=1))
def parsed_elements(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Elements (category, page, section path) of every document whose bytes changed, parsed by unstructured."""
    from pipelines.parse import parse_pending

    with kb.connect() as conn:
        report = parse_pending(conn)
    for failure in report.failures:
        context.log.warning(str(failure))
    return dg.MaterializeResult(metadata=report_metadata(report, "elements"))


@dg.asset(deps=[parsed_elements], group_name=INGESTION, kinds={"python", "postgres"}, code_version=CHUNKER_VERSION)
def chunk_drafts(kb: KnowledgeBase) -> dg.MaterializeResult:
    """Heading-, sentence- and table-aware chunks of changed documents, sized to the embedding model's limit."""
    from pipelines.drafts import chunk_pending

    with kb.connect() as conn:
        report = chunk_pending(conn, kb.embedder.counter)
    return dg.MaterializeResult(metadata=report_metadata(report, "chunks"))


@dg.asset(deps=[chunk_drafts], group_name=INGESTION, kinds={"python", "postgres"}, code_version=ENRICH_VERSION)
def enriched_chunks(kb: KnowledgeBase) -> dg.MaterializeResult:
    """Drafts with their embedded text (title + section path + text), text hash and extracted entities."""
    from pipelines.drafts import enrich_pending

    with kb.connect() as conn:
        report = enrich_pending(conn, kb.embedder.counter)
    return dg.MaterializeResult(metadata=report_metadata(report, "chunks"))


@dg.asset(deps=[enriched_chunks], group_name=EMBEDDINGS, kinds={"pytorch", "pgvector"}, pool="embedding_model",
          retry_policy=dg.RetryPolicy(max_retries=2, delay=10))
def chunk_embeddings(kb: KnowledgeBase) -> dg.MaterializeResult:
    """Vectors for embedded texts the current model has not seen; identical text is never embedded twice."""
    from pipelines.embedding import embed_pending

    with kb.connect() as conn:
        report = embed_pending(conn, kb.embedder)
    metadata = report_metadata(report, "computed")
    metadata["model"] = dg.MetadataValue.text(kb.embedder.model_key)
    return dg.MaterializeResult(metadata=metadata)


@dg.asset(deps=[chunk_embeddings], group_name=EMBEDDINGS, kinds={"postgres", "pgvector"}, pool="postgres")
def published_chunks(kb: KnowledgeBase) -> dg.MaterializeResult:
    """The searchable chunks: each document's new version swapped in atomically, replaced chunks kept as history."""
    from pipelines.publish import publish_ready
    from pipelines.vector_store import ensure_vector_store

    with kb.connect() as conn:
        table = ensure_vector_store(conn, kb.embedder.model_key, kb.embedder.dimensions)
        report = publish_ready(conn, table)
    return dg.MaterializeResult(metadata=report_metadata(report, "chunks_written"))


@dg.asset_check(asset=published_chunks, blocking=True)
def every_live_chunk_is_searchable(kb: KnowledgeBase) -> dg.AssetCheckResult:
    """Each live chunk fits the model's input and has a vector for the current model."""
    from pipelines.checks import unsearchable_chunks

    with kb.connect() as conn:
        problems = unsearchable_chunks(conn, kb.embedder)
    return dg.AssetCheckResult(passed=not any(problems.values()),
                               metadata={k: dg.MetadataValue.int(v) for k, v in problems.items()})


ASSETS = [source_documents, parsed_elements, chunk_drafts, enriched_chunks, chunk_embeddings, published_chunks]
CHECKS = [every_live_chunk_is_searchable]
