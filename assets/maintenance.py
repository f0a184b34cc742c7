"""Model backfills, the model switch-over and the staleness sweep.

`model_backfill` builds the configured model's vectors for every live chunk beside the serving ones. Its work is
split into 16 shards of the text-hash space, each an op of its own, so that an executor spreads them over
processes or, with a distributed executor, over machines (assets/executors.py; in process by default). The shards are units of work, not
data: the asset is one thing, built when all of them are done. They are static ops passing nothing but order
(vectors go to PostgreSQL, never through an IO manager), which is what a distributed executor such as
dagster-dask can schedule up front and what works with no storage shared between machines.
"""

import dagster as dg

from assets.ingestion import OWNERS, PUBLISHED, table
from assets.namespace import DEFAULT, Namespace
from assets.resources import KnowledgeBase
from pipelines.ingest.embed import SHARDS
from pipelines.ingest.flow import FLOW

MAINTENANCE = "maintenance"


def _shard_op(ns: Namespace, shard: str) -> dg.OpDefinition:
    @dg.op(name=ns.name(f"embed_shard_{shard}"), ins={"after": dg.In(dg.Nothing)}, out=dg.Out(dg.Nothing),
           retry_policy=dg.RetryPolicy(max_retries=2, delay=10), tags={"kb/shard": shard})
    def embed_shard(context: dg.OpExecutionContext, kb: KnowledgeBase) -> None:
        """The missing vectors of texts whose hash starts with this hex digit (resumable: a re-run embeds only what
        is still missing): the embed stage of a run over every source, narrowed to this shard, so that it holds the
        sources' locks (shared with the other shards, never with a refresh) and is recorded, with its failures, on
        the backfill's row in ingest_runs like any run."""
        from pipelines.ingest.flow import stage
        from pipelines.ingest.run import IngestRun
        from pipelines.ingest.workers import where

        with kb.connect() as conn, IngestRun.open(conn, kb.settings, kb.embedder, started_by="dagster",
                                                  external_run_id=context.run_id, shard=shard) as run:
            report = run.run_stage(stage("embed"))
        context.add_output_metadata({"shard": shard, "computed": report.counts["computed"],
                                     "elapsed_s": report.elapsed_s, "worker": where()})
    return embed_shard


def backfill_summary(context: dg.OpExecutionContext, kb: KnowledgeBase) -> None:
    """Checks that no shard left a text without a vector, and sums up what the shards did and where they ran."""
    from pipelines.ingest.embed import missing_by_shard

    with kb.connect() as conn:
        missing = missing_by_shard(conn, kb.embedder)
    if missing:
        raise dg.Failure(f"shards {', '.join(sorted(missing))} still lack {sum(missing.values())} vectors of"
                         f" {kb.embedder.model_key}; re-run the backfill (it resumes)",
                         metadata={"missing": dg.MetadataValue.json(missing)})
    # A shard whose worker died may have run twice (dask hands it to another worker): count shards once, work twice.
    outputs = [(e.step_key, e.dagster_event.event_specific_data.metadata)
               for e in context.instance.all_logs(context.run_id, of_type=dg.DagsterEventType.STEP_OUTPUT)
               if e.dagster_event and "embed_shard_" in (e.step_key or "")]
    workers = sorted({m["worker"].value for _, m in outputs if "worker" in m})
    context.add_output_metadata({"computed": sum(m["computed"].value for _, m in outputs if "computed" in m),
                                 "shards_done": len({key for key, _ in outputs}),
                                 "workers": dg.MetadataValue.json(workers),
                                 "model": kb.embedder.model_key})


def build_maintenance(ns: Namespace) -> list[dg.AssetsDefinition]:
    """model_backfill -> active_model, and stale_documents, in `ns`."""
    group = ns.group_of(MAINTENANCE)
    # Op names are shared by a whole code location: each namespace has its own.
    shard_ops = [_shard_op(ns, shard) for shard in SHARDS]
    summary = dg.op(name=ns.name("backfill_summary"), ins={"shards": dg.In(dg.Nothing)},
                    out=dg.Out(dg.Nothing))(backfill_summary)

    @dg.graph_asset(key=ns.key("model_backfill"), group_name=group, kinds={"onnx", "pgvector"}, owners=OWNERS,
                    ins={"published_chunks": dg.AssetIn(key=ns.key(PUBLISHED), dagster_type=dg.Nothing,
                                                        partition_mapping=dg.AllPartitionMapping())})
    def model_backfill(published_chunks):
        """Vectors of the configured model for every live chunk, built beside the serving ones in 16 shards that
        an executor runs in parallel."""
        return summary([shard_op(published_chunks) for shard_op in shard_ops])

    @dg.asset(key=ns.key("active_model"), deps=[model_backfill], group_name=group, kinds={"postgres"},
              owners=OWNERS)
    def active_model(kb: KnowledgeBase) -> dg.MaterializeResult:
        """Search switches to the configured model in one transaction once all its vectors exist; the old model is
        retired, its table kept. The only switch besides a first model's registration: ingests never switch."""
        return switch_model(kb)

    @dg.asset(key=ns.key("stale_documents"),
              deps=[dg.AssetDep(ns.key(FLOW[0].asset), partition_mapping=dg.AllPartitionMapping())],
              group_name=group, kinds={"postgres"}, owners=OWNERS, metadata=table("documents"),
              automation_condition=dg.AutomationCondition.on_cron("30 5 * * *"))
    def stale_documents(kb: KnowledgeBase) -> dg.MaterializeResult:
        """Documents whose source was not crawled within its freshness window (daily, 05:30); purges old history
        if KB_RETENTION_DAYS."""
        return sweep(kb)

    return [model_backfill, active_model, stale_documents]


def switch_model(kb: KnowledgeBase) -> dg.MaterializeResult:
    from pipelines.storage.vectors import activate_if_complete

    with kb.connect() as conn:
        switched = activate_if_complete(conn, kb.embedder.model_key)
    if not switched:
        raise dg.Failure(f"{kb.embedder.model_key} still lacks vectors for some live chunks: finish model_backfill")
    return dg.MaterializeResult(metadata={"model": kb.embedder.model_key})


def sweep(kb: KnowledgeBase) -> dg.MaterializeResult:
    from pipelines.sources.staleness import sweep_sources

    with kb.connect() as conn:
        result = sweep_sources(conn, kb.settings)
        purged = result.get("retention", {})
    table = "\n".join(["| source | stale | last crawled |", "|---|---|---|"] + [
        f"| {s['source_id']} | {s['stale_documents']} | {s['last_crawled_at'].isoformat() if s['last_crawled_at'] else 'never'} |"
        for s in result["sources"]])
    return dg.MaterializeResult(metadata={
        "dagster/row_count": result["stale_documents"],
        "newly_flagged": result["newly_flagged"],
        "oldest_crawl": result["oldest_crawl"].isoformat() if result["oldest_crawl"] else "none",
        "per_source": dg.MetadataValue.md(table),
        **purged,
    })


MAINTENANCE_ASSETS = build_maintenance(DEFAULT)
model_backfill, active_model, stale_documents = MAINTENANCE_ASSETS
