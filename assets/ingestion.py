"""The ingest flow as Dagster assets, generated from its one declaration (pipelines/ingest/flow.py): an asset per
stage, partitioned by declared source, with the stage's description, kinds, table, code version and row count.

One op computes them all: it opens one run (pipelines/ingest/run.py) for the partition's source, which holds the
source's lock from its first stage to its finish, and executes the selected stages in the flow's order. So a
materialization of the whole chain, of a subset (only `qa_cards`), a scheduled refresh or a backfill is exactly
`kb ingest`: one lock, the same transactions, the same gate, a finish however it ends. Its documents are parsed
(and, on dask, embedded) by the deployment's workers (assets/executors.py `refresh_workers`): local processes, or
the dask cluster's workers. A backfill of several sources is one run over all of them
(BackfillPolicy.single_run), the sources locked in order.

Checks, one evaluation per source partition with its own outcome (a backfill of several sources is one step, so
the op names each evaluation's partition itself): the golden set of the source, inside the publishing transaction
(a source without one passes, saying nothing was checked); every live chunk of the source fits the model and has a
vector in the model that serves. Executed alone (a check selected without the stages), they measure what serves now.

A failure that would fail the same way again (the gate, a failed blocking check, an undeclared source, a golden set
that cannot be read) is not retried; the retry policy is for what may pass a moment later (a dropped connection).
"""

import warnings
from collections.abc import Iterator

import dagster as dg
from pydantic import Field

from assets.executors import refresh_workers
from assets.metadata import gate_metadata, rows_held, stage_metadata
from assets.namespace import DEFAULT, Namespace
from assets.resources import KnowledgeBase
from pipelines.ingest.flow import FLOW

OWNERS = ["team:search-platform"]


def table(name: str) -> dict:
    return {"dagster/table_name": f"kb.public.{name}"}


PUBLISHED = next(stage.asset for stage in FLOW if stage.gated)


def specs(ns: Namespace) -> list[dg.AssetSpec]:
    """An asset per stage of the flow, each depending on the stage before it."""
    return [dg.AssetSpec(ns.key(stage.asset), deps=[ns.key(upstream.asset)] if upstream else [],
                         description=stage.description, group_name=ns.group_of(stage.group),
                         kinds=set(stage.technologies), owners=OWNERS, tags={"stage": stage.name},
                         metadata=table(stage.table), code_version=stage.version, partitions_def=ns.sources,
                         skippable=True)
            for upstream, stage in zip((None, *FLOW), FLOW)]


def check_specs(ns: Namespace) -> tuple[dg.AssetCheckSpec, dg.AssetCheckSpec]:
    """(golden set, searchable), the checks of the published asset."""
    with warnings.catch_warnings():  # partitioned checks are a preview in Dagster 1.13: public API, warned at each load
        warnings.simplefilter("ignore", dg.PreviewWarning)
        return (dg.AssetCheckSpec("golden_set_hit_rate", asset=ns.key(PUBLISHED), blocking=True,
                                  partitions_def=ns.sources,
                                  description="hit@5 of the source's golden queries (its golden_set in kb.toml),"
                                              " checked inside the publishing transaction: below the floor the refresh"
                                              " is rolled back. A source without a golden set passes unchecked"),
                dg.AssetCheckSpec("every_live_chunk_is_searchable", asset=ns.key(PUBLISHED), blocking=True,
                                  partitions_def=ns.sources,
                                  description="Every live chunk of the source fits the model's input and has a vector"
                                              " in the model that serves"))


class CrawlConfig(dg.Config):
    """What the operator confirms for this run (the launchpad's run config; each defaults to no)."""

    allow_deletions: bool = Field(default=False, description="documents really are gone: a crawl may soft-delete more than"
                                                       " the source's max_deletion_share")
    accept_new_root: bool = Field(default=False, description="the source's folder really is a new one (moved, remounted):"
                                                       " record it and crawl it")
    retry_failed: bool = Field(default=False, description="parse again the files whose unchanged bytes failed before")


def build_ingest_flow(ns: Namespace, upstreams: list[dg.AssetKey] = ()) -> dg.AssetsDefinition:
    """The flow's assets in `ns`, its first stage depending on the assets that sources declare as their upstream,
    so the lineage graph shows what feeds kb. An edge is between assets, not partitions: every source's partition
    depends on every upstream (AllPartitionMapping), while the refresh is per source (assets/automation.py
    upstream_refresh)."""
    deps = [dg.AssetDep(key, partition_mapping=dg.AllPartitionMapping()) for key in upstreams]
    first = ns.key(FLOW[0].asset)
    flow_specs = [spec.merge_attributes(deps=deps) if deps and spec.key == first else spec for spec in specs(ns)]

    @dg.multi_asset(name=ns.name("ingest_flow"), specs=flow_specs, check_specs=check_specs(ns), can_subset=True,
                    partitions_def=ns.sources, backfill_policy=dg.BackfillPolicy.single_run(),
                    retry_policy=dg.RetryPolicy(max_retries=1, delay=10))
    def ingest_flow(context: dg.AssetExecutionContext, kb: KnowledgeBase, config: CrawlConfig):
        yield from refresh(context, kb, config, ns)

    return ingest_flow


def refresh(context: dg.AssetExecutionContext, kb: KnowledgeBase, config: CrawlConfig, ns: Namespace) -> Iterator:
    """The selected stages of the flow over the partitions' sources, in one run that owns their locks."""
    from pipelines.ingest.golden import GateFailed
    from pipelines.ingest.workers import WorkersUnavailable
    from pipelines.sources.declarations import DeclarationError, load_sources

    source_ids = sorted(context.partition_keys)
    selected = [stage for stage in FLOW if ns.key(stage.asset) in context.selected_asset_keys]
    with kb.connect() as conn:
        undeclared = sorted(set(source_ids) - {s.source_id for s in load_sources(conn, source_ids)})
        if undeclared:
            raise dg.Failure(f"sources {', '.join(undeclared)} are not declared (see `kb source list`); their partitions"
                             f" are left over and the {ns.name('source_partitions')} sensor will remove them",
                             allow_retries=False)
        try:
            if selected:
                yield from _stages(context, conn, kb, config, selected, ns)
            if not any(stage.gated for stage in selected):  # checks without the gated stage: on what serves now
                yield from _checked(context, conn, kb, ns)
        except GateFailed as failed:
            yield from _evaluations(context, conn, kb, ns, failed.gate)
            raise dg.Failure(description=str(failed), metadata=gate_metadata(failed.gate),
                             allow_retries=False) from None
        except DeclarationError as declared:
            raise dg.Failure(description=str(declared), allow_retries=False) from None
        except WorkersUnavailable as unavailable:  # the cluster may be restarting: the retry policy tries again
            raise dg.Failure(description=str(unavailable)) from None


def _stages(context: dg.AssetExecutionContext, conn, kb: KnowledgeBase, config: CrawlConfig,
            selected: list, ns: Namespace) -> Iterator:
    """The selected stages in one run: a materialization of each, every partition with its own row count, and the
    checks after the gated stage."""
    from pipelines.ingest.run import Confirmations, IngestRun

    source_ids = sorted(context.partition_keys)
    with IngestRun.open(conn, kb.settings, kb.embedder, source_ids, started_by="dagster",
                        external_run_id=context.run_id,
                        confirmed=Confirmations(config.allow_deletions, config.accept_new_root, config.retry_failed),
                        workers=refresh_workers(kb.settings)) as run:
        for warning in run.warnings:
            context.log.warning(warning)
        for stage in selected:
            report = run.run_stage(stage)
            for failure in report.failures:
                context.log.warning(str(failure))
            held = rows_held(conn, stage, source_ids)
            if len(source_ids) > 1:  # one source: the materialization's own row count is the partition's
                for source_id, rows in held.items():
                    context.add_asset_metadata({"dagster/row_count": dg.MetadataValue.int(rows)},
                                               asset_key=ns.key(stage.asset), partition_key=source_id)
            yield dg.MaterializeResult(asset_key=ns.key(stage.asset),
                                       metadata=stage_metadata(conn, stage, report, source_ids, kb.embedder, held))
            if stage.gated:
                yield from _checked(context, conn, kb, ns, report.notes.get("gate"))


ingest_flow = build_ingest_flow(DEFAULT)


def _checked(context: dg.AssetExecutionContext, conn, kb: KnowledgeBase, ns: Namespace,
             gate: dict | None = None) -> Iterator[dg.AssetCheckEvaluation]:
    """The selected checks' evaluations; a failed blocking one then fails the step, so that nothing after it runs,
    and without a retry: the same data fails the same way."""
    evaluations = _evaluations(context, conn, kb, ns, gate)
    yield from evaluations
    if failed := [f"{e.check_name} ({e.partition})" for e in evaluations
                  if not e.passed and e.severity == dg.AssetCheckSeverity.ERROR]:
        raise dg.Failure(f"blocking check {', '.join(failed)} failed on {ns.key(PUBLISHED).to_user_string()}: the"
                         " stages after it did not run", allow_retries=False)


def _evaluations(context: dg.AssetExecutionContext, conn, kb: KnowledgeBase, ns: Namespace,
                 gate: dict | None = None) -> list[dg.AssetCheckEvaluation]:
    """One evaluation per selected check and source partition. `gate` is what the run measured inside its publishing
    transaction; without one (the run published nothing, or the checks run alone) the golden sets are measured on what
    serves now: the golden set, the floor or the model may have changed since it was published."""
    from pipelines.ingest.checks import unsearchable_chunks
    from pipelines.ingest.golden import golden_gate

    source_ids, selected = sorted(context.partition_keys), context.selected_asset_check_keys
    golden, searchable = check_specs(ns)
    evaluations = []
    if golden.key in selected:
        where = "on the refresh, inside its publishing transaction" if gate else "on what serves now"
        measured = gate or golden_gate(conn, kb.settings, source_ids)
        evaluations += [_golden(golden, source_id, measured["sources"][source_id], where) for source_id in source_ids]
    if searchable.key in selected:
        for source_id in source_ids:
            problems = unsearchable_chunks(conn, kb.embedder.counter.max_tokens, [source_id])
            evaluations.append(_evaluation(searchable, source_id, passed=not any(problems.values()),
                                           metadata={k: dg.MetadataValue.int(v) for k, v in problems.items()}))
    return evaluations


def _golden(spec: dg.AssetCheckSpec, source_id: str, own: dict, where: str) -> dg.AssetCheckEvaluation:
    if not own["applicable"]:  # not a failure of the source: there is nothing to hold it to
        return _evaluation(spec, source_id, passed=True, metadata={"queries": 0},
                           description="not applicable: the source declares no golden set (golden_set in kb.toml),"
                                       " so nothing was checked")
    return _evaluation(spec, source_id, passed=own["passed"], metadata=gate_metadata(own),
                       description=f"hit@5 of {own['queries']} golden queries {where}")


def _evaluation(spec: dg.AssetCheckSpec, source_id: str, **result) -> dg.AssetCheckEvaluation:
    return dg.AssetCheckEvaluation(asset_key=spec.asset_key, check_name=spec.name, blocking=spec.blocking,
                                   partition=source_id, **result)
