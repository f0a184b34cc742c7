"""The single place that builds kb's Dagster Definitions (code location `kb` in workspace.yaml)."""

import dagster as dg

from assets.automation import SENSORS, ingest_job, reembed_job
from assets.ingestion import ASSETS, CHECKS
from assets.maintenance import MAINTENANCE_ASSETS
from assets.resources import KnowledgeBase

defs = dg.Definitions(
    assets=[*ASSETS, *MAINTENANCE_ASSETS],
    asset_checks=CHECKS,
    jobs=[ingest_job, reembed_job],
    sensors=SENSORS,
    resources={"kb": KnowledgeBase()},
)


# Module-level job factories, so that dg.reconstructable can rebuild a job in another process: the executor's
# subprocesses, or a dask worker on another machine (assets/runs.py).
def ingest_job_def() -> dg.JobDefinition:
    return defs.resolve_job_def("ingest")


def reembed_job_def() -> dg.JobDefinition:
    return defs.resolve_job_def("reembed")
