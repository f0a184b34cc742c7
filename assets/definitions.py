"""The single place that builds kb's Dagster Definitions (loaded by workspace.yaml and `dagster dev`)."""

import dagster as dg

from assets.automation import SENSORS, ingest_job, reembed_job, sweep_job, sweep_schedule
from assets.ingestion import ASSETS, CHECKS
from assets.maintenance import MAINTENANCE_ASSETS
from assets.resources import KnowledgeBase

defs = dg.Definitions(
    assets=[*ASSETS, *MAINTENANCE_ASSETS],
    asset_checks=CHECKS,
    jobs=[ingest_job, sweep_job, reembed_job],
    schedules=[sweep_schedule],
    sensors=SENSORS,
    resources={"kb": KnowledgeBase()},
    executor=dg.multiprocess_executor,
)
