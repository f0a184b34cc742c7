"""Jobs, and the automation that keeps each declared source fresh: its partition kept in step with the
declarations and a refresh when its cron says so, both running from the moment the code location loads (no
click in the UI); a refresh when its files change, off by default (it walks every source folder each minute);
a refresh when the asset a source names as its upstream materializes; and the daily staleness sweep, an automation
condition on its asset evaluated by `kb_automation`.

The per-source pieces are sensors rather than schedules because sources are declared at run time (kb.toml or
`kb source add`), each with its own cron, and a new source must not need a code reload.
"""

import json
import os
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

import dagster as dg

from assets.executors import deployment_dask, local_executor
from assets.ingestion import ingest_flow
from assets.maintenance import active_model, model_backfill, stale_documents
from assets.partitions import SOURCES, partition_changes, sources
from assets.resources import KnowledgeBase

ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.assets(ingest_flow), partitions_def=sources,
                                 tags={"kb/job": "refresh"}, executor_def=local_executor,
                                 description="Crawl one source and bring its part of the knowledge base up to date."
                                             " One step: its documents go to the deployment's workers.")
BACKFILL = dg.AssetSelection.assets(model_backfill, active_model)
reembed_job = dg.define_asset_job("reembed", selection=BACKFILL, tags={"kb/job": "backfill"},
                                  description="Build the configured model's vectors over 16 hash shards, then switch.")
reembed_on_dask_job = dg.define_asset_job(
    "reembed_on_dask", selection=BACKFILL, tags={"kb/job": "backfill"}, executor_def=deployment_dask,
    description="`reembed`, its 16 shards on the deployment's dask cluster (KB_DASK_SCHEDULER).")


def _declared(kb: KnowledgeBase) -> list:
    from pipelines.sources.declarations import load_sources

    with kb.connect() as conn:
        return load_sources(conn)


@dg.sensor(minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def source_partitions(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
    """Adds a partition for each newly declared source and deletes those of removed sources."""
    added, deleted = partition_changes(context.instance.get_dynamic_partitions(SOURCES),
                                       [s.source_id for s in _declared(kb)])
    if not added and not deleted:
        return dg.SkipReason("source partitions match the declared sources")
    requests = ([sources.build_add_request(added)] if added else []) + (
        [sources.build_delete_request(deleted)] if deleted else [])
    return dg.SensorResult(dynamic_partitions_requests=requests)


def _partitioned(context: dg.SensorEvaluationContext, kb: KnowledgeBase) -> list:
    """Declared sources whose partition exists (a brand-new one waits for `source_partitions`)."""
    existing = set(context.instance.get_dynamic_partitions(SOURCES))
    return [s for s in _declared(kb) if s.source_id in existing]


def _refresh(source_id: str, run_key: str, reason: str) -> dg.RunRequest:
    return dg.RunRequest(partition_key=source_id, run_key=run_key, tags={"kb/source": source_id, "kb/reason": reason})


def due_refreshes(sources: Iterable, default_cron: str, last: datetime,
                  now: datetime) -> list[tuple[str, str, datetime]]:
    """(source_id, cron, fired) for each source whose cron (its refresh_cron, else `default_cron`) fired after `last`
    and at or before `now`, with the first time it fired (a tick that is retried asks for the same run). A plain
    function of the two times it is given, so what is due is decided the same way whenever it runs."""
    from croniter import croniter

    due = []
    for source in sources:
        cron = source.refresh_cron or default_cron
        fired = croniter(cron, last).get_next(datetime)
        if fired <= now:
            due.append((source.source_id, cron, fired))
    return due


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def scheduled_refresh_sensor(clock: Callable[[], datetime] = _utc_now) -> dg.SensorDefinition:
    """The `scheduled_refresh` sensor, reading the time from `clock` (timezone-aware): the one Dagster loads reads
    the wall clock; tests build one on a clock they set, so no outcome depends on when the suite runs."""

    @dg.sensor(name="scheduled_refresh", job=ingest_job, minimum_interval_seconds=60,
               default_status=dg.DefaultSensorStatus.RUNNING)
    def scheduled_refresh(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
        """Requests a refresh of each source whose cron (its declared refresh_cron, else KB_REFRESH_CRON) fired
        since the last tick. The first tick only notes the time, so turning the sensor on does not refresh
        everything."""
        now = clock()
        last = datetime.fromisoformat(context.cursor) if context.cursor else now
        due = due_refreshes(_partitioned(context, kb), kb.settings.refresh_cron, last, now)
        context.update_cursor(now.isoformat())
        return [_refresh(source_id, f"{source_id}:cron:{fired.isoformat()}", f"cron {cron}")
                for source_id, cron, fired in due]

    return scheduled_refresh


scheduled_refresh = scheduled_refresh_sensor()


def source_fingerprint(path: str, max_entries: int = 200_000) -> str:
    """Count, total size and newest mtime of a source's files: cheap enough for a 60-second sensor tick."""
    if os.path.isfile(path):
        stat = os.stat(path)
        return f"{stat.st_size}:{stat.st_mtime_ns}"
    count = size = newest = 0
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith(".") or count >= max_entries:
                continue
            try:
                stat = os.stat(os.path.join(dirpath, name))
            except OSError:
                continue
            count, size, newest = count + 1, size + stat.st_size, max(newest, stat.st_mtime_ns)
    return f"{count}:{size}:{newest}"


@dg.sensor(job=ingest_job, minimum_interval_seconds=60, default_status=dg.DefaultSensorStatus.STOPPED)
def source_change_sensor(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
    """Requests a refresh of each folder or JSONL source whose files were added, removed or modified since the last
    tick. Buckets, sites and tables refresh on their cron (or their upstream asset): listing a bucket or crawling a
    site every minute would cost requests (and money) for what a cron run does."""
    from pipelines.sources.declarations import ON_DISK

    seen = json.loads(context.cursor) if context.cursor else {}
    requests = []
    for source in _partitioned(context, kb):
        if source.kind not in ON_DISK:
            continue
        fingerprint = source_fingerprint(str(source.path))
        if seen.get(source.source_id) != fingerprint:
            requests.append(_refresh(source.source_id, f"{source.source_id}:{fingerprint}", "files changed"))
            seen[source.source_id] = fingerprint
    context.update_cursor(json.dumps(seen, sort_keys=True))
    return requests


@dg.sensor(job=ingest_job, minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING)
def upstream_refresh(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
    """Requests a refresh of each source whose declared upstream asset (another code location's, or any asset of the
    instance: a dbt model, an export job) materialized since the last tick. What the sensor last saw of each upstream
    is its cursor; a source it sees for the first time is only noted, so declaring one refreshes nothing by itself."""
    seen = json.loads(context.cursor) if context.cursor else {}
    requests = []
    for source in _partitioned(context, kb):
        if source.upstream is None:
            continue
        records = context.instance.fetch_materializations(dg.AssetKey.from_user_string(source.upstream), limit=1)
        latest = records.records[0].storage_id if records.records else 0
        if source.source_id in seen and latest > seen[source.source_id]:
            requests.append(_refresh(source.source_id, f"{source.source_id}:upstream:{latest}",
                                     f"{source.upstream} materialized"))
        seen[source.source_id] = latest
    context.update_cursor(json.dumps(seen, sort_keys=True))
    return requests


# The staleness sweep's cron (an automation condition on stale_documents), evaluated without a click.
kb_automation = dg.AutomationConditionSensorDefinition("kb_automation", target=dg.AssetSelection.assets(stale_documents),
                                                       default_status=dg.DefaultSensorStatus.RUNNING)

SENSORS = [source_partitions, scheduled_refresh, source_change_sensor, upstream_refresh, kb_automation]
