"""kb's runs on its Dagster instance, from a command: `kb dagster ingest|reembed` execute a job's run here, and the
`kb_cli_runs` sensor records what each `kb ingest` materialized, so that the UI shows every run whichever entry
point started it.

Only Dagster's public API: a command's run is `dg.execute_job` of the job rebuilt from this code's definitions, on
whatever instance is configured, executed in this process through the job's executor (assets/executors.py); a
`kb ingest` is recorded as runless asset events of the sensor's tick after it finished (the command itself never
loads Dagster, which was most of a no-op refresh's time). Neither names a code location: kb may be loaded under any
name, or inside a user's own (assets/definitions.py). The run does not wait in the instance's run queue: the queue's
per-source limit is a courtesy, and the guarantee is the run's own lock on its sources (pipelines/ingest/run.py),
which every entry point takes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import dagster as dg

from assets.namespace import Namespace

# Nothing of Dagster's console log: kb prints the outcome and the reason; the run's events still go to the instance.
QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}


@dataclass
class Outcome:
    run_id: str | None  # None: refused before a run was created (its config)
    success: bool
    failure: str | None
    outputs: dict[str, dict] = field(default_factory=dict)  # step key -> its output metadata, as plain values


def execute(job_name: str, instance: dg.DagsterInstance, partition: str | None = None,
            run_config: dict | None = None) -> Outcome:
    """Run one of kb's jobs to its end in this process; a config Dagster refuses is an outcome, not an error."""
    import uuid

    job = dg.build_reconstructable_job("assets.definitions", "job_named", reconstructable_args=(job_name,))
    command = uuid.uuid4().hex  # finds the run if its executor refuses to start
    tags = {"dagster/partition": partition} if partition else {}
    try:
        result = dg.execute_job(job, instance, run_config={**QUIET, **(run_config or {})},
                                tags={**tags, "kb/started_by": "kb-dagster", "kb/command": command})
    except dg.DagsterInvalidConfigError as refused:  # before a run exists
        return Outcome(None, False, " ".join(str(refused).split()))
    except dg.Failure as refused:  # its executor refused to start (assets/executors.py), after the run was made
        runs = instance.get_runs(dg.RunsFilter(tags={"kb/command": command}))
        for run in runs:
            instance.report_run_failed(run)
        return Outcome(runs[0].run_id if runs else None, False, refused.description)
    events = result.all_events
    failure = next((_why(e.step_failure_data) for e in events if e.is_step_failure), None) or next(
        (_run_failure(e.job_failure_data) for e in events if e.event_type == dg.DagsterEventType.RUN_FAILURE), None)
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


def run_materializations(conn, ns: Namespace, summary, source_ids: list[str], embedder,
                         run_id: int) -> list[dg.AssetMaterialization]:
    """A `kb ingest` run's stages as materializations of their assets in `ns`, one per source, with the metadata a
    Dagster run would attach, so that partitions and the asset catalog show the truth."""
    from assets.metadata import rows_held, stage_metadata
    from pipelines.ingest.flow import stage as flow_stage

    events = []
    for report in summary.stages:
        stage = flow_stage(report.stage)
        held = rows_held(conn, stage, source_ids)
        metadata = {**stage_metadata(conn, stage, report, source_ids, embedder, held),
                    "kb run": dg.MetadataValue.int(run_id)}
        for source_id, rows in held.items():  # each partition's own row count
            events.append(dg.AssetMaterialization(
                asset_key=ns.key(stage.asset), partition=source_id,
                metadata={**metadata, "dagster/row_count": dg.MetadataValue.int(rows)},
                tags={"kb/started_by": "kb-ingest"}))
    return events


# The runs the cursor waits on, then the next runs after its last (any entry point's: the ids a tick sees, and skips,
# are how it notices a run whose row was not yet committed). `superseded`: a later run took one of its sources' locks,
# so a run still unfinished was killed and will never finish (the last column).
RUNS = """
    WITH picked AS (
        SELECT run_id FROM ingest_runs WHERE run_id = ANY(%(waiting)s)
        UNION
        (SELECT run_id FROM ingest_runs WHERE run_id > %(after)s ORDER BY run_id LIMIT %(limit)s))
    SELECT r.run_id, r.started_by = 'cli', r.sources, r.stages, r.finished_at IS NOT NULL,
           r.counters ->> 'outcome',
           EXISTS (SELECT 1 FROM ingest_runs later WHERE later.run_id > r.run_id AND later.sources && r.sources)
    FROM ingest_runs r JOIN picked USING (run_id)
    ORDER BY r.run_id
"""
# A first tick (no cursor) starts from the newest runs: older history is not replayed (the newest may be recorded a
# second time where an older kb recorded its runs itself).
NEWEST = """
    SELECT coalesce(min(run_id) - 1, 0)
    FROM (SELECT run_id FROM ingest_runs WHERE started_by = 'cli' ORDER BY run_id DESC LIMIT %(limit)s) newest
"""
RUNS_PER_TICK = 20  # a tick's events: runs x stages x sources; a backlog is reported over the next ticks
GAP_TICKS = 10  # how many ticks an id the sequence skipped is looked for: a rolled-back insert never appears


@dataclass
class CliRuns:
    """What a tick of the kb_cli_runs sensor reports: the events, the partitions they wait for, the next cursor."""
    events: list[dg.AssetMaterialization]
    partitions: list[str]
    cursor: str


def report_cli_runs(conn, cursor: str | None, ns: Namespace, embedder, partitions: set[str]) -> CliRuns:
    """The materializations of the runs that finished since `cursor`, and the next cursor. A run that failed
    materialized nothing and is not reported; a run stopped by the golden-set gate is, as its stages ran and left
    what they left (its publish rolled back, which its metadata shows). The cursor waits on a run still going (until
    it finishes, or a later run of its sources shows it was killed), on a run whose source has no partition in
    `partitions` yet (the daemon records a tick's events before it adds its partitions), and for GAP_TICKS ticks on
    an id the sequence skipped (a run whose row another session had not committed yet). Row counts and the model
    are read at the tick."""
    from pipelines.ingest.run import GATE_STOPPED, stored_summary
    from pipelines.sources.declarations import load_sources

    state = json.loads(cursor) if cursor else {
        "after": conn.execute(NEWEST, {"limit": RUNS_PER_TICK}).fetchone()[0], "waiting": {}}
    waiting = {int(run_id): ticks for run_id, ticks in state["waiting"].items()}
    rows = conn.execute(RUNS, {"waiting": list(waiting), "after": state["after"], "limit": RUNS_PER_TICK}).fetchall()
    after = max([state["after"], *(row[0] for row in rows)])
    seen = {row[0] for row in rows}
    gaps = {run_id: 0 for run_id in range(state["after"] + 1, after) if run_id not in seen}
    gaps.update({run_id: ticks + 1 for run_id, ticks in waiting.items()
                 if run_id not in seen and ticks + 1 < GAP_TICKS})
    declared = {source.source_id for source in load_sources(conn)}
    events, absent, still = [], set(), {}
    for run_id, cli, sources, stages, finished, outcome, superseded in rows:
        if not cli or (finished and outcome not in ("succeeded", GATE_STOPPED)):
            continue
        if not finished:
            if not superseded:
                still[run_id] = 0
            continue
        sources = [source for source in sources if source in declared]  # a removed source's events would re-add it
        if missing := set(sources) - partitions:
            absent |= missing
            still[run_id] = 0
            continue
        events += run_materializations(conn, ns, stored_summary(stages), sources, embedder, run_id)
    next_waiting = {str(run_id): ticks for run_id, ticks in sorted({**gaps, **still}.items())}
    return CliRuns(events, sorted(absent), json.dumps({"after": after, "waiting": next_waiting}))
