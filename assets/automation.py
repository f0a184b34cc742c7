"""Schedules (a refresh per source, a daily staleness sweep) and a sensor that starts a refresh on file changes."""

import json
import os

import dagster as dg

from assets.ingestion import ASSETS
from assets.maintenance import stale_documents
from assets.partitions import sources
from pipelines.settings import load_settings

ingest_job = dg.define_asset_job("ingest", selection=dg.AssetSelection.assets(*ASSETS), partitions_def=sources,
                                 description="Crawl one source and bring its part of the knowledge base up to date.")
sweep_job = dg.define_asset_job("staleness_sweep", selection=dg.AssetSelection.assets(stale_documents))
reembed_job = dg.define_asset_job("reembed", selection=dg.AssetSelection.groups("maintenance") - dg.AssetSelection.assets(stale_documents),
                                  description="Backfill the configured model's vectors over hash shards, then switch.")


def _refresh_schedule(source_id: str, cron: str) -> dg.ScheduleDefinition:
    @dg.schedule(name=f"refresh_{source_id}", cron_schedule=cron, job=ingest_job,
                 default_status=dg.DefaultScheduleStatus.STOPPED)
    def refresh(context: dg.ScheduleEvaluationContext):
        return dg.RunRequest(partition_key=source_id, tags={"kb/source": source_id})

    return refresh


def refresh_schedules() -> list[dg.ScheduleDefinition]:
    settings = load_settings()
    return [_refresh_schedule(source_id, settings.refresh_cron) for source_id in sorted(settings.sources)]


sweep_schedule = dg.ScheduleDefinition(name="daily_staleness_sweep", cron_schedule="30 5 * * *", job=sweep_job,
                                       default_status=dg.DefaultScheduleStatus.STOPPED)


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
def source_change_sensor(context: dg.SensorEvaluationContext):
    """Requests a refresh of each source whose files were added, removed or modified since the last tick."""
    seen = json.loads(context.cursor) if context.cursor else {}
    requests = []
    for source_id, path in sorted(load_settings().sources.items()):
        fingerprint = source_fingerprint(path)
        if seen.get(source_id) != fingerprint:
            requests.append(dg.RunRequest(partition_key=source_id, run_key=f"{source_id}:{fingerprint}",
                                          tags={"kb/source": source_id}))
            seen[source_id] = fingerprint
    context.update_cursor(json.dumps(seen, sort_keys=True))
    return requests
