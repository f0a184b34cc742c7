"""Model backfills (sharded), the model switch-over and the staleness sweep."""

from datetime import timedelta

import dagster as dg

from assets.partitions import hash_shards
from assets.resources import KnowledgeBase

MAINTENANCE = "maintenance"


@dg.asset(partitions_def=hash_shards, group_name=MAINTENANCE, kinds={"pytorch", "pgvector"}, pool="embedding_model",
          backfill_policy=dg.BackfillPolicy.multi_run(max_partitions_per_run=4))
def model_backfill(context: dg.AssetExecutionContext, kb: KnowledgeBase) -> dg.MaterializeResult:
    """Vectors of the configured model for every live chunk in these hash shards, built beside the serving ones.

    Resumable: a re-run embeds only what is still missing. Fan out with a backfill over all 16 shards."""
    from pipelines.embedding import embed_pending

    with kb.connect() as conn:
        report = embed_pending(conn, kb.embedder, shards=list(context.partition_keys))
    return dg.MaterializeResult(metadata={"computed": report.counts["computed"], "elapsed_s": report.elapsed_s,
                                          "model": kb.embedder.model_key})


@dg.asset(deps=[model_backfill], group_name=MAINTENANCE, kinds={"postgres"})
def active_model(kb: KnowledgeBase) -> dg.MaterializeResult:
    """Search switches to the configured model in one transaction once all its vectors exist; the old index goes."""
    from pipelines.vector_store import activate_if_complete

    with kb.connect() as conn:
        switched = activate_if_complete(conn, kb.embedder.model_key)
    if not switched:
        raise dg.Failure(f"{kb.embedder.model_key} still lacks vectors for some live chunks: finish model_backfill")
    return dg.MaterializeResult(metadata={"model": kb.embedder.model_key})


@dg.asset(group_name=MAINTENANCE, kinds={"postgres"})
def stale_documents(kb: KnowledgeBase) -> dg.MaterializeResult:
    """Documents whose source was not crawled within KB_FRESHNESS_HOURS; purges old history if KB_RETENTION_DAYS."""
    from pipelines.history import purge_history
    from pipelines.staleness import sweep

    with kb.connect() as conn:
        result = sweep(conn, timedelta(hours=kb.settings.freshness_hours))
        purged = purge_history(conn, kb.settings.retention_days) if kb.settings.retention_days is not None else {}
    table = "\n".join(["| source | stale | last crawled |", "|---|---|---|"] + [
        f"| {s['source_id']} | {s['stale_documents']} | {s['last_crawled_at']} |" for s in result["sources"]])
    return dg.MaterializeResult(metadata={
        "stale_documents": result["stale_documents"],
        "dagster/row_count": result["stale_documents"],
        "oldest_crawl": str(result["oldest_crawl"]),
        "per_source": dg.MetadataValue.md(table),
        **purged,
    })


MAINTENANCE_ASSETS = [model_backfill, active_model, stale_documents]
