"""The single place that builds kb's Dagster Definitions (loaded by workspace.yaml and `dagster dev`)."""

import dagster as dg

from assets.automation import (ingest_job, reembed_job, refresh_schedules, source_change_sensor, sweep_job,
                               sweep_schedule)
from assets.ingestion import ASSETS, CHECKS
from assets.maintenance import MAINTENANCE_ASSETS
from assets.resources import KnowledgeBase

defs = dg.Definitions(
    assets=[*ASSETS, *MAINTENANCE_ASSETS],
    asset_checks=CHECKS,
    jobs=[ingest_job, sweep_job, reembed_job],
    schedules=[*refresh_schedules(), sweep_schedule],
    sensors=[source_change_sensor],
    resources={"kb": KnowledgeBase()},
    executor=dg.multiprocess_executor,
)
