"""kb's Dagster Definitions, built by one function for any place they are loaded: kb's own code location (`kb` in
workspace.yaml, module `assets.definitions`), a user's existing code location (`kb_definitions(prefix=...)`
merged into theirs), or a `dg` project (the component in assets/component.py).

They are built when the code location loads (`@dg.definitions`), not when this module is imported: the lineage
graph draws an edge from each asset a source declares as its `upstream` to kb's first asset, and the declarations
are in kb's database. Declaring one draws its edge at the next load (Reload in the UI, or a restart); the refresh
after the upstream materializes needs no reload (the upstream_refresh sensor reads the declarations at each tick).
"""

import logging

import dagster as dg
import psycopg

from assets.automation import build_jobs, build_sensors, source_schedules
from assets.executors import local_executor
from assets.ingestion import build_ingest_flow
from assets.maintenance import build_maintenance
from assets.namespace import DEFAULT, Namespace
from assets.resources import KnowledgeBase
from assets.schema import build_migrate_job
from pipelines.settings import load_settings

log = logging.getLogger(__name__)
KB = KnowledgeBase()  # one resource: kb's definitions under two prefixes merge into one code location


def kb_definitions(prefix: str = DEFAULT.prefix, group: str | None = None, resource: KnowledgeBase | None = None,
                   executor: dg.ExecutorDefinition | None = None) -> dg.Definitions:
    """kb's assets, checks, jobs, schedules and sensors, with asset keys under `prefix` (`kb/published_chunks`),
    jobs, schedules, sensors and partitions named with it (`kb_ingest`), in kb's groups or all in `group`, and
    `resource` as their `kb` resource (settings and secrets come from the code location's environment either way:
    assets/resources.py). Merge them into an existing code location with
    `dg.Definitions.merge(your_defs, kb_definitions())`: kb's jobs name their executors, and `executor` (none
    unless given) is the location's default, for materializations launched from the asset graph; kb's own code
    location gives it in-process (assets/executors.py). kb takes the resource key `kb`. One prefix per knowledge
    base: two prefixes in one code location share its database (and would each refresh its sources); kb's own
    commands (`kb ingest`, `kb dagster ...`) record under the default prefix."""
    ns = Namespace(prefix, group)
    declared = declared_at_load()
    crons = {source.source_id: source.refresh_cron or load_settings().refresh_cron for source in declared}
    schedules = source_schedules(ns, crons)
    flow = build_ingest_flow(ns, upstream_keys(ns, declared))
    maintenance = build_maintenance(ns)
    return dg.Definitions(
        assets=[flow, *maintenance],
        jobs=[*build_jobs(ns, flow, maintenance), build_migrate_job(ns)],
        schedules=list(schedules.values()),
        sensors=build_sensors(ns, maintenance[2], scheduled={source: crons[source] for source in schedules}),
        resources={"kb": resource or KB},
        executor=executor,
    )


@dg.definitions
def defs() -> dg.Definitions:
    return kb_definitions(executor=local_executor)


def declared_at_load() -> list:
    """The sources declared when the code location loads: their upstream assets draw lineage edges, their crons
    become schedules. A database that cannot answer (down, or its schema not yet installed or migrated) gives none
    and says so in the log: the code location still loads, and the sensors take over until the next load."""
    from pipelines.sources.declarations import load_sources
    from pipelines.storage.database import DatabaseUnavailable, connect

    try:
        with connect(load_settings(), install=False) as conn:
            return load_sources(conn)
    except (DatabaseUnavailable, psycopg.Error) as exc:
        log.warning("kb: no lineage edges from upstream assets and no source schedules this load (%s)",
                    " ".join(str(exc).split()))
        return []


def upstream_keys(ns: Namespace, declared: list) -> list[dg.AssetKey]:
    """The upstream assets the declared sources name. One under kb's own prefix would close a cycle: it is skipped,
    with a warning."""
    keys = sorted({dg.AssetKey.from_user_string(source.upstream) for source in declared if source.upstream})
    own = [key for key in keys if key.path[0] == ns.prefix]
    for key in own:
        log.warning("kb: a source declares kb's own asset %s as its upstream: no edge drawn (it would be a cycle);"
                    " name the asset that produces the source's data", key.to_user_string())
    return [key for key in keys if key not in own]


def job_named(name: str) -> dg.JobDefinition:
    """One of kb's jobs, as Dagster rebuilds it in another process (dg.build_reconstructable_job): the executor's
    subprocesses, or a dask worker on another machine (assets/runs.py)."""
    return defs().resolve_job_def(name)
