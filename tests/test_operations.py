"""Operating kb on Dagster as a Dagster engineer expects: a code location named `kb`, runs named after their jobs
on an instance kept in PostgreSQL, quiet runs that print counters, row counts of what assets hold, real lineage,
and a golden-set gate that stops a bad refresh from being served."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import psycopg
import pytest

from assets.definitions import defs
from assets.ingestion import ingest_flow
from assets.maintenance import active_model, model_backfill, stale_documents
from assets.namespace import DEFAULT
from assets.partitions import SOURCES
from assets.resources import KnowledgeBase
from pipelines.ingest.flow import FLOW
from pipelines.ingest.golden import GateFailed
from pipelines.ingest.run import ingest
from pipelines.retrieval.responses import run_search
from pipelines.settings import REPO_ROOT, SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare

KB = str(Path(sys.executable).parent / "kb")
POLICY = "handbook/leave-policy.md"
STAGE_KEYS = [DEFAULT.key(stage.asset) for stage in FLOW]
SOURCE_DOCUMENTS, PUBLISHED = DEFAULT.key("source_documents"), DEFAULT.key("published_chunks")


def kb(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([KB, *args], capture_output=True, text=True, cwd=cwd, env=env or os.environ.copy(),
                          timeout=600)


def small_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "small"
    (folder / "handbook").mkdir(parents=True)
    (folder / "handbook" / "leave-policy.md").write_bytes((SAMPLES_DIR / "docs" / POLICY).read_bytes())
    (folder / "runbook.txt").write_bytes((SAMPLES_DIR / "docs" / "ops" / "postgres-runbook.txt").read_bytes())
    return folder


def test_the_workspace_names_its_code_location_kb(tmp_path):
    out = subprocess.run([str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w",
                          str(REPO_ROOT / "workspace.yaml")], capture_output=True, text=True, cwd=REPO_ROOT,
                         env={**os.environ, "DAGSTER_HOME": str(tmp_path)}, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "code location kb" in out.stdout + out.stderr
    assert "assets.definitions" not in (out.stdout + out.stderr).replace("module_name", "")


def test_kb_dagster_ingest_runs_the_ingest_job_on_a_postgres_instance_and_prints_counters(conn, settings, tmp_path,
                                                                                          monkeypatch):
    add_source(conn, declare("small", small_folder(tmp_path)), "tests")
    first = kb("dagster", "ingest")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "small: run" in first.stdout and "succeeded: 2 documents seen, 2 new" in first.stdout
    printed = first.stdout + first.stderr
    assert "DEBUG" not in printed and "Warning" not in printed and len(printed.splitlines()) <= 3, printed

    again = kb("dagster", "ingest", "small")
    assert again.returncode == 0 and "2 documents seen, 0 new, 0 changed" in again.stdout, again.stdout
    assert "0 skipped, 0 failed; chunks 0 added, 0 updated, 0 closed; 0 embedded;" in again.stdout, again.stdout

    # The instance lives in its own database on kb's server: runs carry their job name and partition.
    from assets.instance import open_instance

    instance_db = psycopg.conninfo.conninfo_to_dict(settings.database_url)
    instance_db["dbname"] += "_dagster"  # beside kb's database, as kb_dagster beside kb
    with psycopg.connect(**instance_db) as dagster_db:
        runs = dagster_db.execute("SELECT pipeline_name, status FROM runs ORDER BY create_timestamp").fetchall()
        assert runs == [("kb_ingest", "SUCCESS"), ("kb_ingest", "SUCCESS")]
    assert not (settings.home / "dagster" / "history").exists()  # no SQLite run storage

    # After the no-op refresh, row counts are what the assets hold, not what the run did.
    live = conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NULL AND kind <> 'card'").fetchone()[0]
    with open_instance(settings) as instance:
        def row_count(key) -> int:
            event = instance.get_latest_materialization_event(key)
            return event.asset_materialization.metadata["dagster/row_count"].value
        assert row_count(SOURCE_DOCUMENTS) == 2
        assert row_count(PUBLISHED) == live > 0
        assert instance.get_latest_materialization_event(PUBLISHED).asset_materialization \
            .metadata["chunks_written"].value == 0
        # The runs are on the configured instance, under their job and partition, with no code location named:
        # kb may be loaded under any name, or inside a user's own code location.
        run = instance.get_runs(dg.RunsFilter(job_name="kb_ingest"))[0]
        assert run.tags["dagster/partition"] == "small" and run.remote_job_origin is None


def test_runs_execute_with_dagsters_own_executors_in_process_unless_a_job_or_run_config_says_otherwise():
    from assets.executors import deployment_dask, local_executor

    for job in ("kb_ingest", "kb_reembed", "__ASSET_JOB"):
        assert defs().resolve_job_def(job).executor_def is local_executor
    assert defs().resolve_job_def("kb_reembed_on_dask").executor_def is deployment_dask
    assert local_executor.config_schema.as_field().default_value == {"in_process": {}}
    assert [job.name for job in defs().jobs] == ["kb_ingest", "kb_reembed", "kb_reembed_on_dask", "kb_migrate"]


def test_kb_uses_only_dagsters_public_api():
    """A private module (`dagster._...`) changes without notice in any Dagster release: none is imported."""
    import re

    from pipelines.settings import REPO_ROOT

    private = re.compile(r"^\s*(from|import)\s+dagster\w*\._", re.MULTILINE)
    offenders = [str(path.relative_to(REPO_ROOT)) for folder in ("assets", "pipelines", "bench", "tests")
                 for path in (REPO_ROOT / folder).rglob("*.py") if private.search(path.read_text())]
    assert offenders == []


def test_every_asset_has_owners_tags_real_upstreams_and_points_at_its_table(conn):
    graph = defs().resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.owners == ["team:search-platform"], key
        assert node.kinds, key
    assert PUBLISHED in graph.get(model_backfill.key).parent_keys
    assert model_backfill.key in graph.get(active_model.key).parent_keys
    assert SOURCE_DOCUMENTS in graph.get(stale_documents.key).parent_keys
    assert graph.get(model_backfill.key).partitions_def is None  # shards are units of work, not partitions
    for key in STAGE_KEYS:
        table = graph.get(key).metadata.get("dagster/table_name")
        if table is not None and "<" not in table:
            assert conn.execute("SELECT to_regclass(%s)", (table.split(".", 1)[1],)).fetchone()[0] is not None
    assert sum("dagster/table_name" in graph.get(key).metadata for key in STAGE_KEYS) == 8
    stages = [graph.get(key).tags.get("stage") for key in STAGE_KEYS]
    assert stages == ["extract", "parse", "chunk", "enrich", "embed", "publish", "cards", "calibrate"]


def test_the_staleness_sweep_runs_on_an_automation_condition_not_a_schedule(conn):
    graph = defs().resolve_asset_graph()
    condition = graph.get(stale_documents.key).automation_condition
    assert condition is not None and "30 5 * * *" in str(condition.get_label() or condition)
    assert list(defs().schedules or []) == []  # schedules are the declared sources' refreshes: none declared


GOLDEN = SAMPLES_DIR / "golden.jsonl"


def run_samples(conn, embedder, folder) -> None:
    add_source(conn, declare("samples", folder, golden_set=GOLDEN), "tests")
    ingest(conn, embedder, load_settings(), ["samples"])


def policy_text(conn) -> str:
    return " ".join(r[0] for r in conn.execute(
        "SELECT c.text FROM chunks c JOIN documents d USING (document_id) WHERE d.locator = %s"
        " AND c.valid_to IS NULL AND c.kind <> 'card' ORDER BY c.ordinal", (POLICY,)))


def break_the_policy(folder: Path) -> None:
    (folder / POLICY).write_text("# Cafeteria menu\n\nMonday: lentil soup. Tuesday: grilled vegetables and rice.\n")


def test_the_golden_gate_stops_a_bad_refresh_and_the_previous_version_keeps_serving(conn, embedder, samples_copy):
    run_samples(conn, embedder, samples_copy)
    serving = policy_text(conn)
    assert "caregiver" in serving

    break_the_policy(samples_copy)
    with pytest.raises(GateFailed) as failed:
        ingest(conn, embedder, load_settings(), ["samples"])
    assert "below the floor 0.8" in str(failed.value) and "primary caregiver" in str(failed.value)
    assert "previous version keeps serving" in str(failed.value)

    assert policy_text(conn) == serving
    top = run_search(conn, load_settings(), "How many weeks of paid leave does a primary caregiver get?", 3)["chunks"]
    assert top[0]["document"] == POLICY and "caregiver" in top[0]["content"]
    stages = conn.execute("SELECT stages FROM ingest_runs ORDER BY run_id DESC LIMIT 1").fetchone()[0]
    assert stages["publish"]["notes"]["published"] is False
    assert stages["publish"]["notes"]["gate"]["hit_rate"] < 0.8

    # The same run again is stopped again: the bad version never slips through on a second try.
    with pytest.raises(GateFailed):
        ingest(conn, embedder, load_settings(), ["samples"])
    assert policy_text(conn) == serving


def test_in_dagster_a_failing_gate_fails_the_publish_step_and_says_why(conn, instance, samples_copy):
    add_source(conn, declare("samples", samples_copy, golden_set=GOLDEN), "tests")
    instance.add_dynamic_partitions(SOURCES, ["samples"])
    resources = {"kb": KnowledgeBase()}
    good = dg.materialize([ingest_flow], resources=resources, instance=instance, partition_key="samples")
    gate = {c.check_name: c for c in good.get_asset_check_evaluations()}["golden_set_hit_rate"]
    assert gate.passed and gate.metadata["queries"].value == 9 and gate.metadata["hit@5"].value == 1.0
    searchable = {c.check_name: c for c in good.get_asset_check_evaluations()}["every_live_chunk_is_searchable"]
    assert searchable.passed and searchable.metadata["without_vector"].value == 0
    serving = policy_text(conn)

    break_the_policy(samples_copy)
    bad = dg.materialize([ingest_flow], resources=resources, instance=instance,
                         partition_key="samples", raise_on_error=False)
    assert not bad.success
    failure = next(e for e in bad.all_events if e.is_step_failure)
    assert failure.step_key == "kb_ingest_flow"
    assert "golden-set gate failed" in failure.event_specific_data.user_failure_data.description
    assert policy_text(conn) == serving
    materialized = {e.asset_key.path[-1] for e in bad.get_asset_materialization_events()}
    assert "chunk_embeddings" in materialized and not {"published_chunks", "qa_cards"} & materialized
    run = conn.execute("SELECT finished_at, counters FROM ingest_runs ORDER BY run_id DESC LIMIT 1").fetchone()
    assert run[0] is not None and run[1]["outcome"] == "stopped by the golden-set gate"  # the run finished


def test_a_gate_with_nothing_to_check_says_so_and_is_no_failure(conn, instance, tmp_path):
    """A source that declares no golden set is not failing anything: its check passes, saying that nothing was
    checked (a WARN failure shows as "Failed" in the UI, on every such source)."""
    add_source(conn, declare("small", small_folder(tmp_path)), "tests")  # declares no golden set
    instance.add_dynamic_partitions(SOURCES, ["small"])
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance,
                            partition_key="small")
    assert result.success  # nothing to check is not a reason to withhold the refresh ...
    gate = {c.check_name: c for c in result.get_asset_check_evaluations()}["golden_set_hit_rate"]
    assert gate.passed and gate.partition == "small" and gate.metadata["queries"].value == 0  # ... nor a failure
    assert "declares no golden set" in gate.description and "nothing was checked" in gate.description


def test_published_chunks_carries_ingest_statistics_with_plots(conn, instance, tmp_path):
    add_source(conn, declare("small", small_folder(tmp_path)), "tests")
    instance.add_dynamic_partitions(SOURCES, ["small"])
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="small")
    meta = {e.asset_key.path[-1]: e.step_materialization_data.materialization.metadata
            for e in result.get_asset_materialization_events()}["published_chunks"]
    formats = meta["documents_per_format"].value
    assert "md" in formats and "txt" in formats
    assert "█" in meta["chunk_tokens"].value
