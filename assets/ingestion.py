"""The ingest flow as Dagster assets, generated from its one declaration (pipelines/ingest/flow.py): an asset per
stage, partitioned by declared source, with the stage's description, kinds, table, code version and row count.

One op computes them all: it opens one run (pipelines/ingest/run.py) for the partition's source, which holds the
source's lock from its first stage to its finish, and executes the selected stages in the flow's order. So a
materialization of the whole chain, of a subset (only `qa_cards`), a scheduled refresh or a backfill is exactly
`kb ingest`: one lock, the same transactions, the same gate, a finish however it ends. Its documents are parsed
(and, on dask, embedded) by the deployment's workers (assets/executors.py `refresh_workers`): local processes, or
the dask cluster's workers. A backfill of several sources is one run over all of them
(BackfillPolicy.single_run), the sources locked in order.

Checks (per partition, against the model that serves): the golden set of the source, inside the publishing
transaction; every live chunk of the source fits the model and has a vector in the serving model.
"""

import dagster as dg
from pydantic import Field

from assets.executors import refresh_workers
from assets.metadata import gate_metadata, stage_metadata
from assets.partitions import sources
from assets.resources import KnowledgeBase
from pipelines.ingest.flow import FLOW

OWNERS = ["team:search-platform"]


def table(name: str) -> dict:
    return {"dagster/table_name": f"kb.public.{name}"}


SPECS = [dg.AssetSpec(stage.asset, deps=[upstream.asset] if upstream else [], description=stage.description,
                      group_name=stage.group, kinds=set(stage.technologies), owners=OWNERS, tags={"stage": stage.name},
                      metadata=table(stage.table), code_version=stage.version, partitions_def=sources, skippable=True)
         for upstream, stage in zip((None, *FLOW), FLOW)]
PUBLISHED = next(stage.asset for stage in FLOW if stage.gated)
GOLDEN = dg.AssetCheckSpec("golden_set_hit_rate", asset=PUBLISHED, blocking=True,
                           description="hit@5 of the source's golden queries (its golden_set in kb.toml), checked"
                                       " inside the publishing transaction: below the floor the refresh is rolled back")
SEARCHABLE = dg.AssetCheckSpec("every_live_chunk_is_searchable", asset=PUBLISHED, blocking=True,
                               description="Every live chunk of the source fits the model's input and has a vector"
                                           " in the model that serves")


class CrawlConfig(dg.Config):
    """What the operator confirms for this run (the launchpad's run config; each defaults to no)."""

    allow_deletions: bool = Field(default=False, description="documents really are gone: a crawl may soft-delete more than"
                                                       " the source's max_deletion_share")
    accept_new_root: bool = Field(default=False, description="the source's folder really is a new one (moved, remounted):"
                                                       " record it and crawl it")
    retry_failed: bool = Field(default=False, description="parse again the files whose unchanged bytes failed before")


@dg.multi_asset(name="ingest_flow", specs=SPECS, check_specs=[GOLDEN, SEARCHABLE], can_subset=True,
                partitions_def=sources, backfill_policy=dg.BackfillPolicy.single_run(),
                retry_policy=dg.RetryPolicy(max_retries=1, delay=10))
def ingest_flow(context: dg.AssetExecutionContext, kb: KnowledgeBase, config: CrawlConfig):
    """The selected stages of the flow over the partitions' sources, in one run that owns their locks."""
    from pipelines.ingest.golden import GateFailed
    from pipelines.ingest.run import Confirmations, IngestRun
    from pipelines.sources.declarations import load_sources

    source_ids = sorted(context.partition_keys)
    selected = [stage for stage in FLOW if dg.AssetKey(stage.asset) in context.selected_asset_keys]
    with kb.connect() as conn:
        undeclared = sorted(set(source_ids) - {s.source_id for s in load_sources(conn, source_ids)})
        if undeclared:
            raise dg.Failure(f"sources {', '.join(undeclared)} are not declared (see `kb source list`); their partitions"
                             " are left over and the source_partitions sensor will remove them")
        try:
            with IngestRun.open(conn, kb.settings, kb.embedder, source_ids, started_by="dagster",
                                external_run_id=context.run_id, confirmed=Confirmations(
                                    config.allow_deletions, config.accept_new_root, config.retry_failed),
                                workers=refresh_workers(kb.settings)) as run:
                for warning in run.warnings:
                    context.log.warning(warning)
                for stage in selected:
                    report = run.run_stage(stage)
                    for failure in report.failures:
                        context.log.warning(str(failure))
                    checks = _checks(context, conn, stage, report, kb)
                    yield dg.MaterializeResult(asset_key=stage.asset,
                                               metadata=stage_metadata(conn, stage, report, source_ids, kb.embedder),
                                               check_results=checks)
                    if failed := [c.check_name for c in checks if not c.passed
                                  and c.severity == dg.AssetCheckSeverity.ERROR]:
                        raise dg.Failure(f"blocking check {', '.join(failed)} failed on {stage.asset}: the stages"
                                         " after it did not run")
        except GateFailed as failed:
            raise dg.Failure(description=str(failed), metadata=gate_metadata(failed.gate)) from None


def with_upstreams(upstreams: list[dg.AssetKey]) -> dg.AssetsDefinition:
    """The flow's assets, its first stage depending on the assets that sources declare as their upstream, so the
    lineage graph shows what feeds kb. An edge is between assets, not partitions: every source's partition depends
    on every upstream (AllPartitionMapping), while the refresh is per source (assets/automation.py
    upstream_refresh)."""
    if not upstreams:
        return ingest_flow
    deps = [dg.AssetDep(key, partition_mapping=dg.AllPartitionMapping()) for key in upstreams]
    first = dg.AssetKey(FLOW[0].asset)
    return dg.map_asset_specs(lambda spec: spec.merge_attributes(deps=deps) if spec.key == first else spec,
                              [ingest_flow])[0]


def _checks(context: dg.AssetExecutionContext, conn, stage, report, kb: KnowledgeBase) -> list[dg.AssetCheckResult]:
    if not stage.gated:
        return []
    from pipelines.ingest.checks import unsearchable_chunks

    results = []
    if GOLDEN.key in context.selected_asset_check_keys:
        results.append(_gate_result(report.notes.get("gate"), kb.settings.golden_floor))
    if SEARCHABLE.key in context.selected_asset_check_keys:
        problems = unsearchable_chunks(conn, kb.embedder.counter.max_tokens, sorted(context.partition_keys))
        results.append(dg.AssetCheckResult(check_name=SEARCHABLE.name, passed=not any(problems.values()),
                                           metadata={k: dg.MetadataValue.int(v) for k, v in problems.items()}))
    return results


def _gate_result(gate: dict | None, floor: float) -> dg.AssetCheckResult:
    if gate is None:
        return dg.AssetCheckResult(check_name=GOLDEN.name, passed=True, description="nothing was published:"
                                   " the serving version did not change", metadata={"floor": floor})
    if not gate["applicable"]:
        return dg.AssetCheckResult(check_name=GOLDEN.name, passed=False, severity=dg.AssetCheckSeverity.WARN,
                                   description="the source declares no golden set (golden_set in kb.toml):"
                                               " nothing was checked", metadata=gate_metadata(gate))
    return dg.AssetCheckResult(check_name=GOLDEN.name, passed=True, metadata=gate_metadata(gate))
