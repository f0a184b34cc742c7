"""Where a run's steps execute: Dagster's own executors, chosen per job as Dagster users choose them.

- `local`, every job's default: Dagster's `multi_or_in_process_executor`, in process unless the run's config asks
  for processes (`execution: {config: {multiprocess: {max_concurrent: 2}}}`). In process by default because a
  refresh is one step (the whole flow under one lock, assets/ingestion.py) and a local embedding model already
  uses every core of one process: each extra process would load it again (bench/README.md). A run may not fork
  more processes than the machine has cores.
- `deployment_dask`, the executor of the `kb_reembed_on_dask` job: dagster-dask's executor on the deployment's own
  scheduler, KB_DASK_SCHEDULER in the environment of the process that starts the run. Its run config is empty: a
  run chooses the job (the cluster or not), never which cluster, since the steps there read every document of a
  restricted source; a run config naming an address is refused by Dagster's config check before anything runs.

A refresh's documents are parsed (and embedded) by the deployment's workers (`refresh_workers`): the dask cluster
when the deployment declares one, else a local pool of KB_PARSE_WORKERS processes, whichever executor runs the
step (`kb ingest` decides the same way).
"""

import os

import dagster as dg

from pipelines.ingest.workers import Workers
from pipelines.settings import Settings

CLUSTER = "KB_DASK_SCHEDULER"


def _at_most_the_cores(config: dict) -> dict:
    """The run's choice as Dagster's executor takes it: nothing else of its config (start methods, preloaded
    modules, retries) is the run's to set, and it forks between one process and one per core."""
    (kind, chosen), = config.items()
    if kind == "multiprocess":
        cores = os.cpu_count() or 1
        return {kind: {"max_concurrent": max(1, min(chosen.get("max_concurrent") or cores, cores))}}
    return {kind: {}}


local_executor = dg.multi_or_in_process_executor.configured(
    _at_most_the_cores, name="local",
    config_schema=dg.Field(dg.Selector({
        "in_process": dg.Field({}, is_required=False, description="Every step in the run's process"),
        "multiprocess": dg.Field({"max_concurrent": dg.Field(int, is_required=False,
                                                             description="at most the cores (default)")},
                                 is_required=False, description="A process per step")}),
        default_value={"in_process": {}}))

@dg.executor(name="deployment_dask", config_schema={}, requirements=dg.multiple_process_executor_requirements())
def deployment_dask(init_context: dg.InitExecutorContext) -> dg.Executor:
    """dagster-dask's executor on the deployment's scheduler, read where the run starts (a step on a worker never
    needs it). dagster-dask imports dask and distributed (1.7 s): they load when such a run starts, not with the
    definitions."""
    from dagster_dask.executor import DaskExecutor

    address = os.environ.get(CLUSTER)
    if not address:
        raise dg.Failure(f"this job runs on the deployment's dask cluster, but {CLUSTER} is not set in the code"
                         " location's environment: set it to the scheduler (tcp://host:8786), or run `kb_reembed`")
    return DaskExecutor("existing", {"address": address})


def refresh_workers(settings: Settings) -> Workers:
    """The workers a refresh parses with: the deployment's dask cluster if it declares one, else local processes."""
    return Workers(settings.parse_workers, os.environ.get(CLUSTER))
