"""The single place that builds kb's Dagster Definitions (code location `kb` in workspace.yaml).

They are built when the code location loads (`@dg.definitions`), not when this module is imported: the lineage
graph draws an edge from each asset a source declares as its `upstream` to kb's first asset, and the declarations
are in kb's database. Declaring one draws its edge at the next load (Reload in the UI, or a restart); the refresh
after the upstream materializes needs no reload (the upstream_refresh sensor reads the declarations at each tick).
"""

import logging

import dagster as dg
import psycopg

from assets.automation import SENSORS, ingest_job, reembed_job, reembed_on_dask_job
from assets.executors import local_executor
from assets.ingestion import ingest_flow, with_upstreams
from assets.maintenance import MAINTENANCE_ASSETS
from assets.resources import KnowledgeBase
from assets.schema import migrate_job
from pipelines.settings import load_settings

# Settings and secrets come from the code location's environment when a step runs (assets/resources.py): nothing of
# them is in the definitions or the launchpad, and no run config can change them.
kb = KnowledgeBase()
log = logging.getLogger(__name__)


@dg.definitions
def defs() -> dg.Definitions:
    return dg.Definitions(
        assets=[with_upstreams(declared_upstreams()), *MAINTENANCE_ASSETS],
        jobs=[ingest_job, reembed_job, reembed_on_dask_job, migrate_job],
        sensors=SENSORS,
        resources={"kb": kb},
        executor=local_executor,
    )


def declared_upstreams() -> list[dg.AssetKey]:
    """The upstream assets the declared sources name. A database that cannot answer (down, or its schema not yet
    installed or migrated) draws no edge and says so in the log: the code location still loads. One of kb's own
    assets would close a cycle: it is skipped, with a warning."""
    from pipelines.sources.declarations import declared_upstreams as read
    from pipelines.storage.database import DatabaseUnavailable, connect

    try:
        with connect(load_settings(), install=False) as conn:
            declared = [dg.AssetKey.from_user_string(key) for key in read(conn)]
    except (DatabaseUnavailable, psycopg.Error) as exc:
        log.warning("kb: no lineage edges from upstream assets this load (%s)", " ".join(str(exc).split()))
        return []
    own = {key for asset in (ingest_flow, *MAINTENANCE_ASSETS) for key in asset.keys}
    for key in sorted(set(declared) & own):
        log.warning("kb: a source declares kb's own asset %s as its upstream: no edge drawn (it would be a cycle);"
                    " name the asset that produces the source's data", key.to_user_string())
    return [key for key in declared if key not in own]


def job_named(name: str) -> dg.JobDefinition:
    """One of kb's jobs, as Dagster rebuilds it in another process (dg.build_reconstructable_job): the executor's
    subprocesses, or a dask worker on another machine (assets/runs.py)."""
    return defs().resolve_job_def(name)
