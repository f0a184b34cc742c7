"""Where a run's steps execute, chosen per run in Dagster's own run config (the launchpad's `execution` block):

    execution: {config: {in_process: {}}}                      # the default: one process, no start-up per step
    execution: {config: {multiprocess: {max_concurrent: 2}}}   # a process per step on this machine
    execution: {config: {dask: {address: tcp://host:8786}}}    # any number of machines running `dask worker`

A source's refresh is one step (the whole flow under one lock, assets/ingestion.py), whose documents are parsed by
the run's workers (`run_workers`): the step's local pool of KB_PARSE_WORKERS processes in process, max_concurrent
processes under multiprocess, and the cluster's workers under dask (the step waits on one of them, seceded from its
threads, so that worker parses too). In process is the default everywhere: the UI, schedules, sensors and
backfills. The model backfill's 16 shards
also run in process by default: a local model already uses every core of one process, and each extra process
would load it again (bench/README.md). dask spreads them over machines that share the PostgreSQL-backed instance
and kb's database (README, "Beyond one machine").
"""

import os

import dagster as dg
from dagster._core.definitions.executor_definition import (
    _core_in_process_executor_creation,
    _core_multiprocess_executor_creation,
    multiple_process_executor_requirements,
)

from pipelines.ingest.workers import Workers
from pipelines.settings import Settings

IN_PROCESS = dg.Field(dg.Shape({}), is_required=False, description="Every step in the run's own process (default).")
MULTIPROCESS = dg.Field({"max_concurrent": dg.Field(int, is_required=False, description="default: the cores")},
                        is_required=False, description="A process per step on this machine.")
DASK = dg.Field({"address": dg.Field(dg.StringSource, description="the dask scheduler, tcp://host:8786")},
                is_required=False, description="Steps on a dask.distributed cluster (dagster-dask).")


def _requirements(config: dict):
    return [] if "in_process" in config else multiple_process_executor_requirements()


@dg.executor(name="kb", config_schema=dg.Field(dg.Selector({"in_process": IN_PROCESS, "multiprocess": MULTIPROCESS,
                                                               "dask": DASK}),
                                               default_value={"in_process": {}}),
             requirements=_requirements)
def kb_executor(init_context: dg.InitExecutorContext) -> dg.Executor:
    """In process by default; multiprocess or dask when the run config asks for them."""
    (kind, config), = init_context.executor_config.items()
    if kind == "dask":
        return _dask_executor(deployment_scheduler(config["address"]))
    if kind == "multiprocess":
        return _core_multiprocess_executor_creation({"retries": {"enabled": {}}, **config})
    return _core_in_process_executor_creation({"retries": {"enabled": {}}, "step_dependency_config": None})


class UndeclaredCluster(dg.Failure):
    """A run config naming a dask scheduler the deployment did not declare."""


def deployment_scheduler(address: str) -> str:
    """The dask scheduler a run asks for, if it is the deployment's own (KB_DASK_SCHEDULER in the code location's
    environment). A run chooses whether its steps run on the cluster, never which cluster: steps there read every
    document of a restricted source, so an address typed into one run's config could send them anywhere."""
    declared = os.environ.get("KB_DASK_SCHEDULER")
    if address != declared:
        raise UndeclaredCluster(
            f"refused: this run's config names the dask scheduler {address!r}, but the deployment declares "
            + (f"{declared!r}" if declared else "none") + " (KB_DASK_SCHEDULER in the code location's environment);"
            " a run may choose to run on the deployment's cluster, not name another one. Nothing was run")
    return address


def _dask_executor(address: str) -> dg.Executor:
    """dagster-dask's executor on an existing cluster, able to run a partition of a source. dask (2024.12 and later)
    walks every tuple among a task's arguments looking for futures; dagster-dask passes the DagsterRun, and the run
    of a dynamic partition (a source) carries a KeyRangesPartitionsSubset, a tuple that refuses iteration, so the
    step failed before it was sent ("Iteration is not allowed on `@record` KeyRangesPartitionsSubset"). The step's
    copy of the run leaves that subset out: Dagster resolves a key-range subset from the run's partition tags anyway
    (DagsterRun.get_resolved_partitions_subset_for_events), which the copy keeps."""
    import copy

    from dagster._core.definitions.partitions.subset.key_ranges import KeyRangesPartitionsSubset
    from dagster_dask.executor import DaskExecutor

    class SourcePartitionDaskExecutor(DaskExecutor):
        def execute(self, plan_context, execution_plan):
            run = plan_context.dagster_run
            if isinstance(run.partitions_subset, KeyRangesPartitionsSubset):
                plan_context = copy.copy(plan_context)
                plan_context._plan_data = plan_context.plan_data._replace(
                    dagster_run=run._replace(partitions_subset=None))
            return super().execute(plan_context, execution_plan)

    return SourcePartitionDaskExecutor("existing", {"address": address})


def run_workers(run_config: dict, settings: Settings) -> Workers:
    """The workers a run's executor has, as a refresh's parse stage uses them: the dask cluster it names, or as
    many local processes as multiprocess may run at once (else KB_PARSE_WORKERS)."""
    (kind, config), = (run_config.get("execution", {}).get("config") or {"in_process": {}}).items()
    if kind == "dask":
        # A StringSource: the address, or {"env": VARIABLE}. The executor checked it was the deployment's before
        # any step started (this runs in the step, maybe on a worker of that cluster, whose environment is not the
        # code location's).
        address = config["address"]
        return Workers(dask=os.environ[address["env"]] if isinstance(address, dict) else address)
    # At most the deployment's KB_PARSE_WORKERS: a run chooses where its steps run, not how many processes it forks.
    return Workers(max(1, min((config or {}).get("max_concurrent") or settings.parse_workers, settings.parse_workers)))
