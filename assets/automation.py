"""Jobs, and the automation that keeps each declared source fresh, running from the moment the code location loads
(no click in the UI), in Dagster's own terms where they express it:

- a schedule per declared source, on its cron (`kb_refresh_<source>`), built from the declarations when the code
  location loads;
- the daily staleness sweep, an automation condition (on_cron) on its asset, evaluated by `kb_automation`;
- sensors for what neither expresses, because sources are declared at run time (kb.toml, `kb source add`) and a
  new or re-timed source must not wait for a code reload: `kb_source_partitions` keeps a dynamic partition per
  declared source, `kb_scheduled_refresh` runs the crons of sources declared or re-timed since the load (an
  automation condition has one cron per asset, not per partition), `kb_upstream_refresh` refreshes a source when
  the asset it names as its upstream materializes (whose key is data, not code), and `kb_source_change_sensor`
  (off by default: it walks every source folder each minute) when its files change; `kb_cli_runs` records the runs
  kb made outside Dagster (`kb ingest`) in the instance.
"""

import json
import logging
import os
import re
from collections.abc import Callable, Iterable
from datetime import datetime, timezone

import dagster as dg

from assets.executors import deployment_dask, local_executor
from assets.ingestion import ingest_flow
from assets.maintenance import MAINTENANCE_ASSETS
from assets.namespace import DEFAULT, Namespace
from assets.partitions import partition_changes
from assets.resources import KnowledgeBase

log = logging.getLogger(__name__)


def build_jobs(ns: Namespace, flow: dg.AssetsDefinition,
               maintenance: list[dg.AssetsDefinition]) -> list:
    """ingest, reembed and reembed_on_dask, named in `ns`."""
    model_backfill, active_model, _ = maintenance
    backfill = dg.AssetSelection.assets(model_backfill, active_model)
    return [
        dg.define_asset_job(ns.name("ingest"), selection=dg.AssetSelection.assets(flow), partitions_def=ns.sources,
                            tags={"kb/job": "refresh"}, executor_def=local_executor,
                            description="Crawl one source and bring its part of the knowledge base up to date. One"
                                        " step: its documents go to the deployment's workers."),
        dg.define_asset_job(ns.name("reembed"), selection=backfill, tags={"kb/job": "backfill"},
                            executor_def=local_executor, description="Build the configured model's vectors over 16 hash shards, then switch."),
        dg.define_asset_job(ns.name("reembed_on_dask"), selection=backfill, tags={"kb/job": "backfill"},
                            executor_def=deployment_dask,
                            description="reembed, its 16 shards on the deployment's dask cluster"
                                        " (KB_DASK_SCHEDULER)."),
    ]


def _declared(kb: KnowledgeBase) -> list:
    from pipelines.sources.declarations import load_sources

    with kb.connect() as conn:
        return load_sources(conn)


def _sync_partitions(context: dg.SensorEvaluationContext, kb: KnowledgeBase, ns: Namespace):
    """Adds a partition for each newly declared source and deletes those of removed sources."""
    added, deleted = partition_changes(context.instance.get_dynamic_partitions(ns.sources.name),
                                       [s.source_id for s in _declared(kb)])
    if not added and not deleted:
        return dg.SkipReason("source partitions match the declared sources")
    requests = ([ns.sources.build_add_request(added)] if added else []) + (
        [ns.sources.build_delete_request(deleted)] if deleted else [])
    return dg.SensorResult(dynamic_partitions_requests=requests)


def _cli_runs(context: dg.SensorEvaluationContext, kb: KnowledgeBase, ns: Namespace) -> dg.SensorResult:
    """Records each run kb made outside Dagster (`kb ingest`) as materializations of the assets it refreshed, with
    the metadata a Dagster run attaches, at the first tick after it finished: the catalog and the partitions show
    every run whichever entry point started it, and `kb ingest` never loads Dagster itself (importing it and
    dagster-postgres was most of a no-op refresh's time). A source a run declared gets its partition here, and its
    run's events at the next tick."""
    from assets.runs import report_cli_runs

    with kb.connect() as conn:
        runs = report_cli_runs(conn, context.cursor, ns, kb.embedder,
                               set(context.instance.get_dynamic_partitions(ns.sources.name)))
    return dg.SensorResult(asset_events=runs.events, cursor=runs.cursor, dynamic_partitions_requests=[
        ns.sources.build_add_request(runs.partitions)] if runs.partitions else None)


def _partitioned(context: dg.SensorEvaluationContext, kb: KnowledgeBase, ns: Namespace) -> list:
    """Declared sources whose partition exists (a brand-new one waits for `source_partitions`)."""
    existing = set(context.instance.get_dynamic_partitions(ns.sources.name))
    return [s for s in _declared(kb) if s.source_id in existing]


def _refresh(source_id: str, run_key: str | None, reason: str) -> dg.RunRequest:
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


def _scheduled(context: dg.SensorEvaluationContext, kb: KnowledgeBase, ns: Namespace,
               clock: Callable[[], datetime], scheduled: dict[str, str]) -> list[dg.RunRequest]:
    """Requests a refresh of each source without a schedule of its own (declared, or given another cron, since the
    code location loaded) whose cron (its refresh_cron, else KB_REFRESH_CRON) fired since the last tick. The first
    tick only notes the time, so turning the sensor on does not refresh everything."""
    now = clock()
    last = datetime.fromisoformat(context.cursor) if context.cursor else now
    unscheduled = [source for source in _partitioned(context, kb, ns)
                   if scheduled.get(source.source_id) != (source.refresh_cron or kb.settings.refresh_cron)]
    due = due_refreshes(unscheduled, kb.settings.refresh_cron, last, now)
    context.update_cursor(now.isoformat())
    return [_refresh(source_id, f"{source_id}:cron:{fired.isoformat()}", f"cron {cron}")
            for source_id, cron, fired in due]


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


def _changed(context: dg.SensorEvaluationContext, kb: KnowledgeBase, ns: Namespace) -> list[dg.RunRequest]:
    """Requests a refresh of each folder or JSONL source whose files were added, removed or modified since the last
    tick. Buckets, sites and tables refresh on their cron (or their upstream asset): listing a bucket or crawling a
    site every minute would cost requests (and money) for what a cron run does."""
    from pipelines.sources.declarations import ON_DISK

    seen = json.loads(context.cursor) if context.cursor else {}
    requests = []
    for source in _partitioned(context, kb, ns):
        if source.kind not in ON_DISK:
            continue
        fingerprint = source_fingerprint(str(source.path))
        if seen.get(source.source_id) != fingerprint:
            requests.append(_refresh(source.source_id, f"{source.source_id}:{fingerprint}", "files changed"))
            seen[source.source_id] = fingerprint
    context.update_cursor(json.dumps(seen, sort_keys=True))
    return requests


def _upstreams(context: dg.SensorEvaluationContext, kb: KnowledgeBase, ns: Namespace) -> list[dg.RunRequest]:
    """Requests a refresh of each source whose declared upstream asset (another code location's, or any asset of the
    instance: a dbt model, an export job) materialized since the last tick. What the sensor last saw of each upstream
    is its cursor; a source it sees for the first time is only noted, so declaring one refreshes nothing by itself."""
    seen = json.loads(context.cursor) if context.cursor else {}
    requests = []
    for source in _partitioned(context, kb, ns):
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


def source_schedules(ns: Namespace, crons: dict[str, str]) -> dict[str, dg.ScheduleDefinition]:
    """A schedule per source declared when the code location loaded, on its cron (`crons`: source -> cron): what
    Dagster users look for on the Automation page, with its next tick. A source declared or given another cron since
    is the scheduled_refresh sensor's until the next load; its schedule then skips, saying why. A cron Dagster
    refuses (declared before kb checked for five fields, or a KB_REFRESH_CRON) gets no schedule, with a warning, so
    that the code location still loads: the sensor refreshes that source."""
    schedules = {}
    for source_id, cron in sorted(crons.items()):
        try:
            schedules[source_id] = _source_schedule(ns, source_id, cron)
        except dg.DagsterInvalidDefinitionError as refused:
            log.warning("kb: no schedule for the source %s: Dagster refuses its cron %r (%s); %s refreshes it",
                        source_id, cron, " ".join(str(refused).split()), ns.name("scheduled_refresh"))
    return schedules


def schedule_name(ns: Namespace, source_id: str) -> str:
    """A schedule's name for a source: Dagster allows letters, digits and _ only, so a source named with . or - is
    told apart from its look-alike by a hash of its name."""
    import hashlib

    slug = re.sub(r"[^A-Za-z0-9_]", "_", source_id)
    if slug != source_id:
        slug += "_" + hashlib.sha1(source_id.encode()).hexdigest()[:6]
    return ns.name(f"refresh_{slug}")


def _source_schedule(ns: Namespace, source_id: str, cron: str) -> dg.ScheduleDefinition:
    @dg.schedule(name=schedule_name(ns, source_id), cron_schedule=cron, execution_timezone="UTC",
                 job_name=ns.name("ingest"), default_status=dg.DefaultScheduleStatus.RUNNING,
                 description=f"Refresh the source {source_id} on its cron ({cron}).")
    def refresh(context: dg.ScheduleEvaluationContext, kb: KnowledgeBase):
        from pipelines.sources.declarations import load_sources

        with kb.connect() as conn:
            now = [source.refresh_cron or kb.settings.refresh_cron for source in load_sources(conn, [source_id])]
        if now != [cron]:
            return dg.SkipReason(f"{source_id} is no longer declared with this cron ({cron}); until the code location"
                                 " reloads, scheduled_refresh refreshes it as declared now")
        if source_id not in context.instance.get_dynamic_partitions(ns.sources.name):
            return dg.SkipReason(f"{source_id} has no partition yet: the source_partitions sensor adds it")
        return _refresh(source_id, None, f"cron {cron}")

    return refresh


def build_sensors(ns: Namespace, stale_documents: dg.AssetsDefinition, clock: Callable[[], datetime] = _utc_now,
                  scheduled: dict[str, str] | None = None) -> list[dg.SensorDefinition]:
    """kb's sensors in `ns`, requesting runs of its ingest job. `scheduled_refresh` leaves alone the sources that
    have a schedule (`scheduled`: source -> the cron it was built with) and reads the time from `clock`
    (timezone-aware): the one Dagster loads reads the wall clock, tests build one on a clock they set, so no outcome
    depends on when the suite runs."""
    refreshes = {"job_name": ns.name("ingest"), "default_status": dg.DefaultSensorStatus.RUNNING}

    @dg.sensor(name=ns.name("source_partitions"), minimum_interval_seconds=30,
               default_status=dg.DefaultSensorStatus.RUNNING, description=_sync_partitions.__doc__)
    def source_partitions(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
        return _sync_partitions(context, kb, ns)

    @dg.sensor(name=ns.name("cli_runs"), minimum_interval_seconds=30, default_status=dg.DefaultSensorStatus.RUNNING,
               description=_cli_runs.__doc__)
    def cli_runs(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
        return _cli_runs(context, kb, ns)

    @dg.sensor(name=ns.name("scheduled_refresh"), minimum_interval_seconds=60, description=_scheduled.__doc__,
               **refreshes)
    def scheduled_refresh(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
        return _scheduled(context, kb, ns, clock, scheduled or {})

    @dg.sensor(name=ns.name("source_change_sensor"), minimum_interval_seconds=60, description=_changed.__doc__,
               **{**refreshes, "default_status": dg.DefaultSensorStatus.STOPPED})
    def source_change_sensor(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
        return _changed(context, kb, ns)

    @dg.sensor(name=ns.name("upstream_refresh"), minimum_interval_seconds=30, description=_upstreams.__doc__,
               **refreshes)
    def upstream_refresh(context: dg.SensorEvaluationContext, kb: KnowledgeBase):
        return _upstreams(context, kb, ns)

    # The staleness sweep's cron (an automation condition on stale_documents), evaluated without a click.
    automation = dg.AutomationConditionSensorDefinition(ns.name("automation"),
                                                        target=dg.AssetSelection.assets(stale_documents),
                                                        default_status=dg.DefaultSensorStatus.RUNNING)
    return [source_partitions, scheduled_refresh, source_change_sensor, upstream_refresh, automation, cli_runs]


JOBS = build_jobs(DEFAULT, ingest_flow, MAINTENANCE_ASSETS)
ingest_job, reembed_job, reembed_on_dask_job = JOBS
SENSORS = build_sensors(DEFAULT, MAINTENANCE_ASSETS[2])
source_partitions, scheduled_refresh, source_change_sensor, upstream_refresh, kb_automation, cli_runs = SENSORS


def scheduled_refresh_sensor(clock: Callable[[], datetime]) -> dg.SensorDefinition:
    """kb's `scheduled_refresh` sensor, reading the time from `clock`."""
    return build_sensors(DEFAULT, MAINTENANCE_ASSETS[2], clock)[1]
