"""kb's runs on its Dagster instance, from a command: `kb dagster ingest|reembed` execute a job's run here, and
`kb ingest` records what it materialized, so that the UI shows every run whichever entry point started it.

A command's run is created the way the code location `kb` (workspace.yaml) creates one, with its origin, so the
UI lists it under the location's job (Overview, Runs) like a run launched there; it executes in this process
through the run's executor (in process by default; `execution` in run config picks multiprocess or dask). It does
not wait in the instance's run queue: the queue's per-source limit is a courtesy, and the guarantee is the run's
own lock on its sources (pipelines/ingest/run.py), which every entry point takes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import dagster as dg

from pipelines.settings import REPO_ROOT

# Nothing of Dagster's console log: kb prints the outcome and the reason; the run's events still go to the instance.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
LOCATION = "kb"  # workspace.yaml's location_name
REPOSITORY = "__repository__"  # the name Dagster gives the repository of a module's Definitions


@dataclass
class Outcome:
    run_id: str
    success: bool
    failure: str | None
    outputs: dict[str, dict] = field(default_factory=dict)  # step key -> its output metadata, as plain values


def _origin(job_name: str):
    """The job's origin in the code location `kb`, as the webserver records it on runs it launches."""
    from dagster._core.remote_origin import (
        ManagedGrpcPythonEnvCodeLocationOrigin,
        RemoteJobOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    target = LoadableTargetOrigin(executable_path=sys.executable, module_name="assets.definitions",
                                  working_directory=str(REPO_ROOT))
    location = ManagedGrpcPythonEnvCodeLocationOrigin(target, LOCATION)
    return RemoteJobOrigin(repository_origin=RemoteRepositoryOrigin(location, REPOSITORY), job_name=job_name)


def execute(job_name: str, instance: dg.DagsterInstance, partition: str | None = None,
            run_config: dict | None = None) -> Outcome:
    from dagster._core.execution.api import execute_run

    from assets import definitions

    job = dg.reconstructable(getattr(definitions, f"{job_name}_job_def"))
    tags = {"dagster/partition": partition} if partition else {}
    run = instance.create_run_for_job(job.get_definition(), run_config={**QUIET, **(run_config or {})},
                                      tags={**tags, "kb/started_by": "kb-dagster"}, remote_job_origin=_origin(job_name),
                                      job_code_origin=job.get_python_origin())
    try:
        execute_run(job, run, instance)
    except dg.Failure as refused:  # the run could not start (an executor refused its config): it failed, say why
        instance.report_run_failed(run)
        return Outcome(run.run_id, False, refused.description)
    events = [record.dagster_event for record in instance.all_logs(run.run_id) if record.dagster_event]
    failure = next((_why(e.event_specific_data) for e in events if e.is_step_failure), None) or next(
        (_run_failure(e.event_specific_data) for e in events if e.event_type == dg.DagsterEventType.RUN_FAILURE),
        None)
    outputs = {e.step_key: {k: v.value for k, v in e.event_specific_data.metadata.items()}
               for e in events if e.is_successful_output}
    success = instance.get_run_by_id(run.run_id).status == dg.DagsterRunStatus.SUCCESS
    return Outcome(run.run_id, success, failure, outputs)


def _why(failure) -> str:
    """A dg.Failure's own description (kb's one-line reasons), else the error's message."""
    if failure.user_failure_data is not None and failure.user_failure_data.description:
        return failure.user_failure_data.description
    return failure.error.message.strip() if failure.error else "the step failed"


def _run_failure(data) -> str | None:
    """Why a run failed outside any step (the executor could not start: a dask scheduler that does not answer)."""
    error = getattr(data, "error", None)
    return error.message.strip() if error else None


def record_materializations(instance: dg.DagsterInstance, conn, summary, source_ids: list[str], embedder,
                            run_id: int) -> int:
    """Record a `kb ingest` run's stages as materializations of their assets, one per source, with the metadata a
    Dagster run would attach, so that partitions and the asset catalog show the truth. Returns how many."""
    from assets.metadata import stage_metadata
    from assets.partitions import sync_source_partitions
    from pipelines.ingest.flow import stage as flow_stage
    from pipelines.sources.declarations import load_sources

    sync_source_partitions(instance, [s.source_id for s in load_sources(conn)])
    recorded = 0
    for report in summary.stages:
        stage = flow_stage(report.stage)
        metadata = {**stage_metadata(conn, stage, report, source_ids, embedder),
                    "kb run": dg.MetadataValue.int(run_id)}
        for source_id in source_ids:
            instance.report_runless_asset_event(dg.AssetMaterialization(
                asset_key=stage.asset, partition=source_id, metadata=metadata,
                tags={"kb/started_by": "kb-ingest"}))
            recorded += 1
    return recorded
