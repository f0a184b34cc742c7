"""Where a job's steps run.

A source's refresh is a short linear chain: it runs in process (no subprocess, no interpreter start-up per step).
The model backfill fans out over its shards: over local processes by default. With KB_DASK_SCHEDULER set
(tcp://host:8786), both run on a dask.distributed cluster through dagster-dask: any number of machines running
`dask worker`, with the code location installed, sharing the PostgreSQL-backed Dagster instance and kb's
database, take steps as they come (README: "Beyond one machine").
"""

import os

import dagster as dg


def _dask_address() -> str | None:
    return os.environ.get("KB_DASK_SCHEDULER") or None


def _dask():
    address = _dask_address()
    if not address:
        return None
    from dagster_dask import dask_executor

    return dask_executor.configured({"cluster": {"existing": {"address": address}}}, name="dask")


def refresh_executor() -> dg.ExecutorDefinition:
    return _dask() or dg.in_process_executor


def backfill_executor() -> dg.ExecutorDefinition:
    return _dask() or dg.multiprocess_executor


def model_pool() -> str | None:
    """The concurrency pool of steps that load the embedding model (at most one per slot, so that concurrent runs on
    one machine do not each load a model). Not on dask: a run that carries pool information holds a Dagster
    `@record`, which dask's argument packing tries to iterate, and the submission fails; there, each worker's thread
    count is the limit."""
    return None if _dask_address() else "embedding_model"
