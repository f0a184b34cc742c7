"""Running kb's jobs on its instance from a command (`kb dagster ingest`, `kb dagster reembed`): through each job's
own executor (in process, local processes, or a dask cluster), quietly, and reporting what the run did."""

from __future__ import annotations

from dataclasses import dataclass, field

import dagster as dg

# Nothing of Dagster's console log: kb prints the outcome and the reason; the run's events still go to the instance.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


@dataclass
class Outcome:
    run_id: str
    success: bool
    failure: str | None
    outputs: dict[str, dict] = field(default_factory=dict)  # step key -> its output metadata, as plain values


def execute(job_name: str, instance: dg.DagsterInstance, partition: str | None = None) -> Outcome:
    from assets import definitions

    job = dg.reconstructable(getattr(definitions, f"{job_name}_job_def"))
    tags = {"dagster/partition": partition} if partition else None
    with dg.execute_job(job, instance, run_config=QUIET, tags=tags) as result:
        events = result.all_events
        failure = next((_why(e.event_specific_data) for e in events if e.is_step_failure), None) or next(
            (_run_failure(e.event_specific_data) for e in events if e.event_type == dg.DagsterEventType.RUN_FAILURE),
            None)
        outputs = {e.step_key: {k: v.value for k, v in e.event_specific_data.metadata.items()}
                   for e in events if e.is_successful_output}
        return Outcome(result.run_id, result.success, failure, outputs)


def _why(failure) -> str:
    """A dg.Failure's own description (kb's one-line reasons), else the error's message."""
    if failure.user_failure_data is not None and failure.user_failure_data.description:
        return failure.user_failure_data.description
    return failure.error.message.strip() if failure.error else "the step failed"


def _run_failure(data) -> str | None:
    """Why a run failed outside any step (the executor could not start: a dask scheduler that does not answer)."""
    error = getattr(data, "error", None)
    return error.message.strip() if error else None
