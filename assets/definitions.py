"""The single place that builds kb's Dagster Definitions (code location `kb` in workspace.yaml)."""

import dagster as dg

from assets.automation import SENSORS, ingest_job, reembed_job
from assets.executors import kb_executor
from assets.ingestion import ingest_flow
from assets.maintenance import MAINTENANCE_ASSETS
from assets.resources import KnowledgeBase
from assets.schema import migrate_job

# Settings and secrets come from the code location's environment when a step runs (assets/resources.py): nothing of
# them is in the definitions or the launchpad, and no run config can change them.
kb = KnowledgeBase()

defs = dg.Definitions(
    assets=[ingest_flow, *MAINTENANCE_ASSETS],
    jobs=[ingest_job, reembed_job, migrate_job],
    sensors=SENSORS,
    resources={"kb": kb},
    executor=kb_executor,
)


# Module-level job factories, so that dg.reconstructable can rebuild a job in another process: the executor's
# subprocesses, or a dask worker on another machine (assets/runs.py).
def ingest_job_def() -> dg.JobDefinition:
    return defs.resolve_job_def("ingest")


def reembed_job_def() -> dg.JobDefinition:
    return defs.resolve_job_def("reembed")
