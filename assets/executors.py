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


# A local model uses every core in one process, and a step's process start is mostly imports: on one machine the
# backfill's shards run one at a time in processes forked from a server that imported the model's libraries once
# (1,223 chunks int8 -> fp32 on 2 cores: 179.8 s with a fresh process per shard and two at a time, 71.4 s so;
# bench/README.md). A remote model (openai) is network-bound: its shards run as many at a time as there are cores.
LOCAL_MODEL_LIBRARIES = {"local": ["onnxruntime", "tokenizers"], "local-fp32": ["torch", "sentence_transformers"]}


def backfill_executor() -> dg.ExecutorDefinition:
    dask = _dask()
    if dask:
        return dask
    libraries = LOCAL_MODEL_LIBRARIES.get(os.environ.get("KB_EMBEDDER", "local").lower())
    if libraries is None:
        return dg.multiprocess_executor
    return dg.multiprocess_executor.configured(
        {"max_concurrent": 1,
         "start_method": {"forkserver": {"preload_modules": [*libraries, "assets.definitions"]}}},
        name="multiprocess")


def model_pool() -> str | None:
    """The concurrency pool of steps that load the embedding model (at most one per slot, so that concurrent runs on
    one machine do not each load a model). Not on dask: a run that carries pool information holds a Dagster
    `@record`, which dask's argument packing tries to iterate, and the submission fails; there, each worker's thread
    count is the limit."""
    return None if _dask_address() else "embedding_model"
