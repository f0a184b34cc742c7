"""The Dagster layer, as a Dagster user meets it: definitions that load without heavy imports, the plain Dagster
commands on a fresh clone, automation that runs without a click, every run visible in the instance, and one run
object that owns its lock, its gate and its finish whichever entry point starts it."""

import json
import os
import shutil
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import dagster as dg
import pytest

from assets.automation import (SENSORS, cli_runs, ingest_job, kb_automation, scheduled_refresh,
                               scheduled_refresh_sensor, source_change_sensor, upstream_refresh)
from assets.definitions import defs
from assets.ingestion import ingest_flow
from assets.namespace import DEFAULT
from assets.partitions import SOURCES, sources
from assets.resources import KnowledgeBase
from pipelines.ingest.flow import FLOW
from pipelines.settings import REPO_ROOT, SAMPLES_DIR
from pipelines.sources.declarations import add_source, declare

BIN = Path(sys.executable).parent
STAGE_KEYS = [DEFAULT.key(stage.asset) for stage in FLOW]


def declare_sources(conn, instance, **locations) -> None:
    """Declare sources in the database and give each its partition, as `kb source add` does."""
    for name, location in locations.items():
        add_source(conn, declare(name, location), "tests")
    instance.add_dynamic_partitions(SOURCES, list(locations))


def test_definitions_load_with_the_stage_lineage(settings):
    graph = defs().resolve_asset_graph()
    keys = STAGE_KEYS
    assert set(keys) <= set(graph.get_all_asset_keys())
    for upstream, downstream in zip(keys, keys[1:]):
        assert upstream in graph.get(downstream).parent_keys
    assert defs().resolve_job_def(ingest_job.name).partitions_def == sources


def test_loading_definitions_imports_neither_torch_nor_unstructured():
    code = "import sys, assets.definitions; print(sorted(m for m in ('torch', 'unstructured', 'sentence_transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout
    assert out.strip() == "[]"


def test_assets_materialize_in_process_and_report_metadata(conn, instance):
    declare_sources(conn, instance, samples=SAMPLES_DIR / "docs")
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples")
    assert result.success
    meta = {e.asset_key.path[-1]: e.step_materialization_data.materialization.metadata
            for e in result.get_asset_materialization_events()}
    assert meta["source_documents"]["seen"].value == 9
    assert meta["source_documents"]["new"].value == 9
    assert meta["parsed_elements"]["parsed"].value == 9
    assert meta["chunk_embeddings"]["computed"].value == meta["published_chunks"]["chunks_inserted"].value > 0
    assert "elapsed_s" in meta["published_chunks"]

    rerun = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples")
    again = {e.asset_key.path[-1]: e.step_materialization_data.materialization.metadata
             for e in rerun.get_asset_materialization_events()}
    assert again["source_documents"]["unchanged"].value == 9
    assert again["source_documents"]["crawls"].value == (
        "- `samples`: 9 listed, 0 read, 9 unchanged (9 not read: size and mtime), 0 failed, 0 deleted")
    assert again["chunk_embeddings"]["computed"].value == 0
    assert again["published_chunks"]["chunks_written"].value == 0


def test_sensor_requests_a_refresh_only_for_sources_that_changed(conn, instance, samples_copy):
    declare_sources(conn, instance, samples=samples_copy, faq=SAMPLES_DIR / "faq.jsonl",
                    site="https://intranet.example.com/docs/", bucket="s3://handbook/policies/")
    resources = {"kb": KnowledgeBase()}
    first = source_change_sensor(dg.build_sensor_context(instance=instance, resources=resources))
    assert sorted(r.partition_key for r in first) == ["faq", "samples"]
    context = dg.build_sensor_context(instance=instance, cursor=_cursor_after(first), resources=resources)
    assert list(source_change_sensor(context)) == []
    (samples_copy / "handbook" / "new-policy.md").write_text("# New policy\n\nEffective immediately.")
    context = dg.build_sensor_context(instance=instance, cursor=_cursor_after(first), resources=resources)
    assert [r.partition_key for r in source_change_sensor(context)] == ["samples"]


def test_each_run_kb_made_outside_dagster_is_recorded_once_after_it_finishes(conn, instance, settings, embedder):
    """`kb ingest` never loads Dagster: the kb_cli_runs sensor records each run that finished as materializations of
    the assets it refreshed, once; a run still going is recorded at the first tick after it finishes, one that failed
    never (it materialized nothing). Killed runs, which never finish, do not hold the cursor back, and a run whose
    row another session commits after a later run's is still recorded."""
    import psycopg

    from pipelines.ingest.run import IngestRun, ingest

    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl"), "tests")
    instance.add_dynamic_partitions(SOURCES, ["faq"])
    resources = {"kb": KnowledgeBase()}

    def tick(cursor):
        result = cli_runs(dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources))
        return result.asset_events, result.cursor

    def recorded(cursor):
        events, cursor = tick(cursor)
        return sorted({e.metadata["kb run"].value for e in events}), cursor

    with IngestRun.open(conn, settings, embedder, ["faq"]) as run:
        events, cursor = tick(None)
        run.run_all()
    assert events == []
    events, cursor = tick(cursor)
    assert [(e.asset_key, e.partition) for e in events] == [(key, "faq") for key in STAGE_KEYS]
    published = next(e for e in events if e.asset_key == DEFAULT.key("published_chunks"))
    assert published.metadata["dagster/row_count"].value == conn.execute(
        "SELECT count(*) FROM chunks WHERE valid_to IS NULL AND kind <> 'card'").fetchone()[0] > 0
    assert published.metadata["kb run"].value == run.run_id
    assert recorded(cursor)[0] == [], "each run once"
    with pytest.raises(RuntimeError), IngestRun.open(conn, settings, embedder, ["faq"]):
        raise RuntimeError("the run failed before any stage")
    assert recorded(cursor)[0] == []

    # 25 runs killed mid-way (their rows never finish), then a run that does.
    conn.execute("INSERT INTO ingest_runs (sources) SELECT ARRAY['faq'] FROM generate_series(1, 25)")
    done, cursor = recorded(cursor)
    assert done == []
    ingest(conn, embedder, settings, ["faq"])
    finished = conn.execute("SELECT max(run_id) FROM ingest_runs").fetchone()[0]
    for _ in range(3):
        done, cursor = recorded(cursor)
        if done:
            break
    assert done == [finished] and json.loads(cursor)["waiting"] == {}, "the killed runs are superseded, not awaited"

    # A run whose row is committed after a later run's: the tick between sees the later one, then the earlier.
    with psycopg.connect(settings.database_url) as other:  # a transaction open until the block ends
        hidden = other.execute("INSERT INTO ingest_runs (sources, stages, finished_at, counters) SELECT sources,"
                               " stages, now(), counters FROM ingest_runs WHERE run_id = %s RETURNING run_id",
                               (finished,)).fetchone()[0]
        ingest(conn, embedder, settings, ["faq"])
        later = conn.execute("SELECT max(run_id) FROM ingest_runs").fetchone()[0]
        done, cursor = recorded(cursor)
        assert later > hidden and done == [later]
    assert recorded(cursor)[0] == [hidden]


def test_a_source_refreshes_when_its_upstream_asset_materializes(conn, instance, tmp_path):
    """A source that names the asset producing it (another code location's export, a dbt model) is refreshed after
    each materialization of that asset, once per materialization; declaring it refreshes nothing by itself."""
    export = tmp_path / "faq.jsonl"
    export.write_text((SAMPLES_DIR / "faq.jsonl").read_text())
    add_source(conn, declare("faq", export, groups=["support"], upstream="marts/faq"), "tests")
    add_source(conn, declare("other", SAMPLES_DIR / "docs", groups=["support"]), "tests")
    instance.add_dynamic_partitions(SOURCES, ["faq", "other"])
    resources = {"kb": KnowledgeBase()}

    def tick(cursor):
        context = dg.build_sensor_context(instance=instance, cursor=cursor, resources=resources)
        return list(upstream_refresh(context)), context.cursor

    requests, cursor = tick(None)
    assert requests == []
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=["marts", "faq"]))
    requests, cursor = tick(cursor)
    assert [(r.partition_key, r.tags["kb/reason"]) for r in requests] == [("faq", "marts/faq materialized")]
    assert tick(cursor)[0] == [], "one materialization, one refresh"
    instance.report_runless_asset_event(dg.AssetMaterialization(asset_key=["marts", "other"]))
    assert tick(cursor)[0] == []


def test_the_lineage_graph_draws_an_edge_from_each_declared_upstream_asset(conn, tmp_path, caplog, monkeypatch):
    """The asset a source names as its upstream (another code location's) feeds kb's first asset in the lineage
    graph, from the declarations when the code location loads; kb's own asset named there would be a cycle and is
    skipped with a warning; a database that cannot answer draws no edge and the code location still loads."""
    first = DEFAULT.key(FLOW[0].asset)
    assert defs().resolve_asset_graph().get(first).parent_keys == set()
    export = tmp_path / "faq.jsonl"
    export.write_text((SAMPLES_DIR / "faq.jsonl").read_text())
    add_source(conn, declare("faq", export, groups=["support"], upstream="marts/faq"), "tests")
    add_source(conn, declare("loop", SAMPLES_DIR / "docs", groups=["support"], upstream="kb/published_chunks"), "tests")
    graph = defs().resolve_asset_graph()
    assert graph.get(first).parent_keys == {dg.AssetKey(["marts", "faq"])}
    assert "kb's own asset kb/published_chunks" in caplog.text
    assert dg.AssetKey(["marts", "faq"]) not in graph.materializable_asset_keys  # drawn, not materialized by kb

    monkeypatch.setenv("DATABASE_URL", "postgresql://nobody@127.0.0.1:1/none")
    assert defs().resolve_asset_graph().get(first).parent_keys == set()
    assert "no lineage edges from upstream assets and no source schedules this load" in caplog.text


def _cursor_after(requests) -> str:
    import json

    return json.dumps({r.partition_key: r.run_key.split(":", 1)[1] for r in requests}, sort_keys=True)


def test_the_plain_dagster_commands_work_from_a_fresh_clone_with_no_kb_environment(fresh_clone, tmp_path):
    """In a fresh clone, with an empty HOME and no KB_*, DATABASE_URL or DAGSTER_HOME: Dagster reads ./dagster.yaml,
    whose storage finds kb's database the way kb does (the per-user home), starting the embedded server itself; the
    run's materializations are what kb holds. A ./.kb beside the checkout the suite runs from (`make demo` leaves
    one) is neither read nor written."""
    home = tmp_path / "home"
    home.mkdir()
    # The clone's own code, as `make install` in the clone would give (an editable install of it).
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "PYTHONPATH": str(fresh_clone)}

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=fresh_clone, env=env, capture_output=True, text=True, timeout=600)

    applied = run(str(BIN / "kb"), "source", "apply", "samples/kb.toml")
    assert applied.returncode == 0, applied.stderr
    materialized = run(str(BIN / "dagster"), "asset", "materialize", "-m", "assets.definitions",
                       "--select", "group:ingestion or group:embeddings", "--partition", "faq")
    assert materialized.returncode == 0, materialized.stderr[-3000:]
    status = json.loads(run(str(BIN / "kb"), "status", "--json").stdout)
    faq = next(s for s in status["sources"] if s["source_id"] == "faq")
    assert faq["documents"] == 4 and faq["chunks"] > 0 and status["last_run"]["started_by"] == "dagster"
    assert status["home"] == {"path": str(home / ".local" / "share" / "kb"), "found": "per-user default",
                              "database": "embedded"}
    shown = json.loads(run(str(BIN / "kb"), "source", "show", "faq", "--json").stdout)
    assert shown["source"]["declared_in"] == str(fresh_clone / "samples" / "kb.toml")  # the clone's, read in place
    code = ("import dagster as dg; from assets.instance import open_instance; from pipelines.settings import"
            " load_settings; i = open_instance(load_settings());"
            " print(sorted(i.get_materialized_partitions(dg.AssetKey(['kb', 'qa_cards']))))")
    assert run(sys.executable, "-c", code).stdout.strip() == "['faq']"
    assert not (fresh_clone / ".kb").exists()  # nor a fresh, empty knowledge base where the commands ran


def test_a_wrong_database_url_under_dagsters_own_cli_is_one_line(tmp_path):
    """`dagster asset materialize` as the README runs it (./dagster.yaml, no DAGSTER_HOME) with a DATABASE_URL where
    nothing listens. The instance's storage is on kb's server, so it fails before any run exists: one `Error:` line
    naming DATABASE_URL and the fix, exit 2, where it was 66 lines of traceback through Dagster's internals."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    shutil.copy(REPO_ROOT / "dagster.yaml", tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "DAGSTER_HOME"} | {
        "DATABASE_URL": f"postgresql://nobody@127.0.0.1:{port}/kb", "KB_HOME": str(tmp_path / "home")}
    out = subprocess.run([str(BIN / "dagster"), "asset", "materialize", "-m", "assets.definitions", "--select",
                          "group:ingestion or group:embeddings", "--partition", "samples"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}/kb" in errors[0] and "check DATABASE_URL" in errors[0], out.stderr


def test_a_database_that_cannot_serve_kb_fails_the_run_with_its_line(instance, monkeypatch):
    """With the instance elsewhere (its own postgres_url), the run starts and its first step meets the wrong
    DATABASE_URL: the step fails with kb's line as the failure's description. A server that does not answer may be
    restarting: that is retried once, as the step's policy says (a deterministic failure is not: see
    test_deterministic_failures_are_not_retried_and_a_dropped_connection_is)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DATABASE_URL", f"postgresql://nobody@127.0.0.1:{port}/kb")
    instance.add_dynamic_partitions(SOURCES, ["docs"])
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="docs",
                            raise_on_error=False)
    assert not result.success
    assert len([e for e in result.all_events if e.event_type == dg.DagsterEventType.STEP_UP_FOR_RETRY]) == 1
    [failure] = result.get_step_failure_events()
    description = failure.step_failure_data.user_failure_data.description
    assert f"127.0.0.1:{port}/kb" in description and "check DATABASE_URL" in description


def test_declared_crons_fire_without_a_click(conn, instance, tmp_path):
    for sensor in (scheduled_refresh, kb_automation):
        assert sensor.default_status == dg.DefaultSensorStatus.RUNNING, sensor.name
    assert {s.name for s in SENSORS} >= {"kb_source_partitions", "kb_scheduled_refresh", "kb_automation"}
    for name in ("minutely", "yearly"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.md").write_text("# A\n\nSome text.\n")
    add_source(conn, declare("minutely", tmp_path / "minutely", refresh_cron="* * * * *"), "tests")
    add_source(conn, declare("yearly", tmp_path / "yearly", refresh_cron="0 0 1 1 *"), "tests")
    instance.add_dynamic_partitions(SOURCES, ["minutely", "yearly"])
    now = datetime(2026, 12, 31, 23, 59, 30, tzinfo=timezone.utc)  # a set clock: the yearly cron is 30 s away
    context = dg.build_sensor_context(instance=instance, cursor=(now - timedelta(minutes=2)).isoformat(),
                                      resources={"kb": KnowledgeBase()})
    assert [r.partition_key for r in scheduled_refresh_sensor(clock=lambda: now)(context)] == ["minutely"]


def test_each_source_declared_at_load_has_its_schedule_and_the_sensor_takes_the_rest(conn, instance, tmp_path):
    """Dagster users find a schedule per source on the Automation page, on the source's cron; the sensor refreshes
    only what the schedules cannot know: a source declared, or given another cron, since the code location loaded.
    No source is refreshed twice for one cron tick."""
    from assets.automation import build_sensors
    from assets.maintenance import stale_documents
    from pipelines.sources.declarations import update_source

    for name in ("nightly", "hourly", "later"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "a.md").write_text("# A\n\nSome text.\n")
    add_source(conn, declare("nightly", tmp_path / "nightly", refresh_cron="0 3 * * *"), "tests")
    add_source(conn, declare("hourly", tmp_path / "hourly"), "tests")  # KB_REFRESH_CRON's hourly default
    loaded = defs()
    schedules = {schedule.name: schedule for schedule in loaded.schedules}
    assert {name: s.cron_schedule for name, s in schedules.items()} == {"kb_refresh_nightly": "0 3 * * *",
                                                                         "kb_refresh_hourly": "0 * * * *"}
    assert all(s.default_status == dg.DefaultScheduleStatus.RUNNING for s in schedules.values())
    instance.add_dynamic_partitions(SOURCES, ["nightly", "hourly", "later"])
    resources = {"kb": KnowledgeBase()}

    def tick(name: str):
        return schedules[name].evaluate_tick(dg.build_schedule_context(
            instance=instance, resources=resources, repository_def=loaded.get_repository_def(),
            scheduled_execution_time=datetime(2026, 12, 2, 3, tzinfo=timezone.utc)))

    assert [r.partition_key for r in tick("kb_refresh_nightly").run_requests] == ["nightly"]

    update_source(conn, "nightly", "tests", refresh_cron="30 3 * * *")  # re-timed after the load
    add_source(conn, declare("later", tmp_path / "later"), "tests")  # declared after the load
    skipped = tick("kb_refresh_nightly")
    assert skipped.run_requests == [] and "no longer declared with this cron" in skipped.skip_message
    now = datetime(2026, 12, 2, 3, 45, tzinfo=timezone.utc)
    sensor = build_sensors(DEFAULT, stale_documents, clock=lambda: now, scheduled={
        "nightly": "0 3 * * *", "hourly": "0 * * * *"})[1]  # the crons the schedules were built with
    context = dg.build_sensor_context(instance=instance, cursor=(now - timedelta(hours=1)).isoformat(),
                                      resources=resources)
    assert sorted(r.partition_key for r in sensor(context)) == ["later", "nightly"]  # hourly is its schedule's


def test_a_cron_dagster_refuses_never_takes_the_code_location_down(conn, tmp_path, caplog):
    """A six-field cron (croniter reads seconds, Dagster's schedules do not) is refused when declared; one stored
    before that check gets no schedule, a warning, and the sensor's refreshes: the code location still loads."""
    from pipelines.sources.declarations import DeclarationError

    with pytest.raises(DeclarationError, match="five fields"):
        declare("odd", tmp_path, refresh_cron="0 3 * * * 30")
    add_source(conn, declare("odd", tmp_path, refresh_cron="0 3 * * *"), "tests")
    conn.execute("UPDATE sources SET refresh_cron = '0 3 * * * 30' WHERE source_id = 'odd'")  # an older declaration
    loaded = defs()
    dg.Definitions.validate_loadable(loaded)
    assert list(loaded.schedules) == [] and "no schedule for the source odd" in caplog.text


def test_a_refresh_that_changes_nothing_still_holds_the_source_to_its_golden_set(conn, instance, tmp_path):
    """The golden set (or the floor, or the model) may change while the documents do not: a no-op refresh measures
    what serves against it, and says so."""
    golden = tmp_path / "golden.jsonl"
    golden.write_text(json.dumps({"query": "okapi forest", "document": "notes:okapi.md"}) + "\n")
    add_source(conn, declare("notes", one_note(tmp_path), golden_set=golden), "tests")
    instance.add_dynamic_partitions(SOURCES, ["notes"])

    def refresh():
        return dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance,
                              partition_key="notes", raise_on_error=False)

    assert refresh().success
    golden.write_text(json.dumps({"query": "okapi forest", "document": "notes:elsewhere.md"}) + "\n")
    again = refresh()
    check = checks_by_partition(again)["golden_set_hit_rate", "notes"]
    assert not check.passed and "on what serves now" in check.description and not again.success


def test_a_cli_run_is_visible_in_the_instance_with_the_assets_metadata(conn, instance, tmp_path):
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.md").write_text("# A\n\nThe okapi lives in the Ituri forest.\n")
    out = subprocess.run([str(BIN / "kb"), "ingest", str(folder), "--source", "notes", "--public"], capture_output=True,
                         text=True, env=os.environ.copy(), timeout=600)
    assert out.returncode == 0, out.stderr
    assert "declared source notes" in out.stderr  # kb ingest PATH says what it declared
    assert instance.get_materialized_partitions(STAGE_KEYS[0]) == set()  # `kb ingest` itself does not load Dagster
    cursor = None
    for _ in range(2):  # the first tick asks for the new source's partition, the next records the run
        tick = cli_runs(dg.build_sensor_context(instance=instance, cursor=cursor, resources={"kb": KnowledgeBase()}))
        for event in tick.asset_events:  # what the daemon does with a tick, in its order: the events, the partitions
            instance.report_runless_asset_event(event)
        for request in tick.dynamic_partitions_requests:
            instance.add_dynamic_partitions(request.partitions_def_name, request.partition_keys)
        cursor = tick.cursor
    assert instance.get_dynamic_partitions(SOURCES) == ["notes"]
    for key in STAGE_KEYS:
        assert instance.get_materialized_partitions(key) == {"notes"}, key
    event = instance.get_latest_materialization_event(DEFAULT.key("published_chunks")).asset_materialization
    assert event.partition == "notes" and event.metadata["dagster/row_count"].value == 1
    assert event.metadata["documents"].value == 1 and "elapsed_s" in event.metadata


def test_a_subset_materialization_finishes_its_run(conn, instance):
    from pipelines.storage.vectors import active_model

    declare_sources(conn, instance, faq=SAMPLES_DIR / "faq.jsonl")
    for selection in (["kb/source_documents"], ["kb/qa_cards"], ["kb/chunk_embeddings", "kb/published_chunks"]):
        result = dg.materialize([ingest_flow], selection=selection, resources={"kb": KnowledgeBase()},
                                instance=instance, partition_key="faq")
        assert result.success, selection
        finished, counters = conn.execute("SELECT finished_at, counters FROM ingest_runs WHERE external_run_id = %s",
                                          (result.run_id,)).fetchone()
        assert finished is not None and counters["outcome"] == "succeeded", selection
    assert active_model(conn) is not None  # the first model serves from its registration (nothing served before)


def test_the_run_holds_its_sources_locks_from_first_stage_to_finish(conn, settings, embedder):
    import psycopg

    from pipelines.ingest.flow import stage
    from pipelines.ingest.run import IngestRun

    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl"), "tests")

    def free() -> bool:
        with psycopg.connect(settings.database_url, autocommit=True) as other:
            taken = other.execute("SELECT pg_try_advisory_lock(x'6b62'::int, hashtext('faq'))").fetchone()[0]
            if taken:
                other.execute("SELECT pg_advisory_unlock(x'6b62'::int, hashtext('faq'))")
            return taken

    with IngestRun.open(conn, settings, embedder, ["faq"]) as run:
        run.run_stage(stage("extract"))
        assert not free()  # between stages, no other run of the source can start
        run.run_stage(stage("parse"))
        assert not free()
    assert free()


def test_a_source_named_like_the_samples_is_not_held_to_their_golden_set(tmp_path):
    """A company source that happens to be called `faq` declares no golden set: its refreshes are not checked
    against the bundled samples' queries (they used to be, and were refused)."""
    records = tmp_path / "faq.jsonl"
    records.write_text(json.dumps({"_id": "vpn", "title": "VPN", "text": "Reset your VPN token in the portal."}) + "\n")
    out = subprocess.run([str(BIN / "kb"), "ingest", str(records), "--source", "faq", "--public", "--json"],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["documents_published"] == 1


def test_the_check_reads_the_serving_model_and_its_own_partition(conn, settings, embedder, tmp_path):
    """During a model switch (another model being built, without vectors yet) a source's live chunks are still
    searchable; a chunk without a vector in another source does not fail this one."""
    from pipelines.ingest.checks import unsearchable_chunks
    from pipelines.ingest.run import ingest
    from pipelines.storage.vectors import ensure_vector_store, vector_table

    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl"), "tests")
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.md").write_text("# A\n\nA sentence about zebras.\n")
    add_source(conn, declare("other", other), "tests")
    ingest(conn, embedder, settings)
    ensure_vector_store(conn, "test:model-being-built:384", 384)  # a switch under way: nothing embedded yet
    conn.execute(f"DELETE FROM {vector_table(conn, embedder.model_key).as_string(conn)} v USING chunks c"
                 " JOIN documents d USING (document_id) WHERE d.source_id = 'other' AND c.text_hash = v.text_hash")
    assert unsearchable_chunks(conn, 256, ["faq"]) == {"without_vector": 0, "over_token_limit": 0}
    assert unsearchable_chunks(conn, 256, ["other"])["without_vector"] == 1


def test_skipped_files_show_in_the_stage_metadata_beside_their_count():
    from assets.metadata import report_metadata
    from pipelines.ingest.failures import Failure
    from pipelines.ingest.report import StageReport

    report = StageReport("extract", ("seen", "skipped"))
    report.skip(Failure("share", "logo.png", "extract", "unsupported file type .png"))
    metadata = report_metadata(report)
    assert metadata["skipped"].value == 1 and "failures" not in metadata
    assert metadata["skipped files"].value == "- `share:logo.png`: unsupported file type .png"


PUBLISHED_KEY = DEFAULT.key("published_chunks")
GOLDEN_CHECK = dg.AssetCheckKey(PUBLISHED_KEY, "golden_set_hit_rate")
SEARCHABLE_CHECK = dg.AssetCheckKey(PUBLISHED_KEY, "every_live_chunk_is_searchable")


def one_note(tmp_path: Path, text: str = "The okapi lives in the Ituri forest.") -> Path:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "okapi.md").write_text(f"# Okapi\n\n{text}\n")
    return folder


def checks_by_partition(result) -> dict:
    return {(e.check_name, e.partition): e for e in result.get_asset_check_evaluations()}


def attempts(result) -> tuple[int, int]:
    """(steps started, steps sent back for a retry) in a run's events."""
    types = [e.event_type for e in result.all_events]
    return types.count(dg.DagsterEventType.STEP_START), types.count(dg.DagsterEventType.STEP_UP_FOR_RETRY)


def test_a_run_over_two_sources_gives_each_partition_its_own_row_count_and_check_results(conn, instance, tmp_path):
    """A backfill of two sources is one step: each partition's materialization still holds its own source's rows,
    and each check has one result per partition with its own outcome; a source without a golden set passes, saying
    that nothing was checked (never a failure, not even a warning)."""
    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl", golden_set=SAMPLES_DIR / "golden.jsonl"), "tests")
    add_source(conn, declare("notes", one_note(tmp_path)), "tests")
    instance.add_dynamic_partitions(SOURCES, ["faq", "notes"])
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance,
                            tags={"dagster/asset_partition_range_start": "faq",
                                  "dagster/asset_partition_range_end": "notes"})
    assert result.success
    counts = {e.partition: e.step_materialization_data.materialization.metadata["dagster/row_count"].value
              for e in result.get_asset_materialization_events() if e.asset_key == PUBLISHED_KEY}
    held = dict(conn.execute("SELECT d.source_id, count(*) FROM chunks c JOIN documents d USING (document_id)"
                             " WHERE c.valid_to IS NULL AND c.kind <> 'card' GROUP BY 1").fetchall())
    assert counts == held and counts["notes"] == 1 < counts["faq"]

    checks = checks_by_partition(result)
    assert set(checks) == {(check.name, source) for check in (GOLDEN_CHECK, SEARCHABLE_CHECK)
                           for source in ("faq", "notes")}
    assert all(evaluation.passed for evaluation in checks.values())
    faq, notes = checks["golden_set_hit_rate", "faq"], checks["golden_set_hit_rate", "notes"]
    assert faq.metadata["queries"].value == 1 and faq.metadata["hit@5"].value == 1.0
    assert notes.severity == dg.AssetCheckSeverity.ERROR and "nothing was checked" in notes.description
    for check in (GOLDEN_CHECK, SEARCHABLE_CHECK):  # what the UI lists: an execution per partition, none left planned
        records = instance.event_log_storage.get_asset_check_execution_history(check, limit=10)
        assert sorted((r.partition, r.status.value) for r in records) == [("faq", "SUCCEEDED"), ("notes", "SUCCEEDED")]


def test_a_check_executed_alone_evaluates_what_serves_now(conn, settings, embedder, instance, tmp_path):
    """Selecting only the checks runs no stage and opens no ingest run, yet evaluates them: a chunk that lost its
    vector fails `every_live_chunk_is_searchable`, and the golden set is searched on what is published."""
    from pipelines.ingest.run import ingest
    from pipelines.storage.vectors import vector_table

    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl", golden_set=SAMPLES_DIR / "golden.jsonl"), "tests")
    instance.add_dynamic_partitions(SOURCES, ["faq"])
    ingest(conn, embedder, settings, ["faq"])
    runs = conn.execute("SELECT count(*) FROM ingest_runs").fetchone()[0]

    def checks_alone():
        return dg.materialize([ingest_flow], selection=dg.AssetSelection.checks(GOLDEN_CHECK, SEARCHABLE_CHECK),
                              resources={"kb": KnowledgeBase()}, instance=instance, tags={"dagster/partition": "faq"},
                              raise_on_error=False)

    healthy = checks_alone()
    assert healthy.success and not healthy.get_asset_materialization_events()
    checks = checks_by_partition(healthy)
    assert set(checks) == {("golden_set_hit_rate", "faq"), ("every_live_chunk_is_searchable", "faq")}
    assert checks["golden_set_hit_rate", "faq"].passed and checks["golden_set_hit_rate", "faq"].metadata[
        "queries"].value == 1 and "on what serves now" in checks["golden_set_hit_rate", "faq"].description
    assert checks["every_live_chunk_is_searchable", "faq"].passed

    conn.execute(f"DELETE FROM {vector_table(conn, embedder.model_key).as_string(conn)}")
    broken = checks_alone()
    assert not broken.success
    searchable = checks_by_partition(broken)["every_live_chunk_is_searchable", "faq"]
    assert not searchable.passed and searchable.metadata["without_vector"].value > 0
    assert attempts(broken) == (1, 0)  # the same data fails the same way: no retry
    assert conn.execute("SELECT count(*) FROM ingest_runs").fetchone()[0] == runs


def test_deterministic_failures_are_not_retried_and_a_dropped_connection_is(conn, instance, tmp_path, monkeypatch):
    """The gate, a golden set that cannot be read and an undeclared source fail the same way on a second attempt:
    one attempt each. A dropped connection may not: the step is retried, and the retry succeeds."""
    import psycopg

    import pipelines.sources.declarations as declarations

    golden = tmp_path / "golden.jsonl"
    golden.write_text(json.dumps({"query": "okapi", "document": "notes:missing.md"}) + "\n")
    add_source(conn, declare("notes", one_note(tmp_path), golden_set=golden), "tests")
    instance.add_dynamic_partitions(SOURCES, ["notes", "gone"])
    resources = {"kb": KnowledgeBase()}

    def run(partition: str, **selection):
        return dg.materialize([ingest_flow], resources=resources, instance=instance, partition_key=partition,
                              raise_on_error=False, **selection)

    def failure(result) -> str:
        return next(e for e in result.all_events if e.is_step_failure).event_specific_data.user_failure_data.description

    gated = run("notes")
    assert attempts(gated) == (1, 0) and "golden-set gate failed on notes: hit@5 0.00" in failure(gated)
    gate = checks_by_partition(gated)["golden_set_hit_rate", "notes"]
    assert not gate.passed and gate.metadata["hit@5"].value == 0.0  # the check says what was measured

    golden.write_text("not json\n")
    unreadable = run("notes")
    assert attempts(unreadable) == (1, 0) and "its golden_set" in failure(unreadable)

    undeclared = run("gone")
    assert attempts(undeclared) == (1, 0) and "are not declared" in failure(undeclared)

    real, dropped = declarations.load_sources, []

    def drops_once(*args, **kwargs):
        if not dropped:
            dropped.append(True)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real(*args, **kwargs)

    monkeypatch.setattr(declarations, "load_sources", drops_once)
    retried = run("notes", selection=["kb/source_documents"])
    assert retried.success and attempts(retried) == (1, 1)
