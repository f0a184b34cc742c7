"""The `migrate` job: `kb migrate` from Dagster, for deployments operated from its UI. It installs or upgrades kb's
schema under the migration lock, logs what is pending and about how long it will take before it starts, then each
file's time, and returns what it applied. Serving and the sensors never migrate (a migration may rebuild HNSW
indexes for minutes); they name the pending files until this job, or `kb migrate`, has run.
"""

import dagster as dg

from assets.executors import local_executor
from assets.namespace import DEFAULT, Namespace
from assets.resources import KnowledgeBase


def migrate_schema(context: dg.OpExecutionContext, kb: KnowledgeBase) -> list[str]:
    """Install or upgrade kb's schema (pipelines/storage/migrations.py), logging what and how long."""
    from pipelines.storage.database import location, upgrade_schema
    from pipelines.storage.migrations import RATES, duration, estimate

    def before(conn, files) -> None:
        costs = {item.name: estimate(conn, item) for item in files}
        context.log.info(f"{len(files)} pending in {location(kb.settings)}: "
                         + "; ".join(f"{name} ({cost.describe()})" for name, cost in costs.items()))
        context.log.info(f"estimate: {duration(sum(cost.seconds for cost in costs.values()))} ({RATES})")

    applied = upgrade_schema(kb.settings, before=before,
                             applied=lambda item, seconds: context.log.info(f"applied {item.name} in {seconds:.2f} s"))
    context.log.info(f"kb's schema is up to date: {', '.join(applied) or 'nothing to migrate'}")
    return applied


def build_migrate_job(ns: Namespace) -> dg.JobDefinition:
    """The job and its op, both named in `ns` (op names are shared by a whole code location)."""
    migrate = dg.op(name=ns.name("migrate_schema"), description=migrate_schema.__doc__)(migrate_schema)

    @dg.job(name=ns.name("migrate"), tags={"kb/job": "schema"},
            description="Install or upgrade kb's schema (`kb migrate`).", executor_def=local_executor)
    def migrate_job():
        migrate()

    return migrate_job


migrate_job = build_migrate_job(DEFAULT)
