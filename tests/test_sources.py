"""Declared sources: kb.toml and `kb source ...`, the audit trail, Dagster's partitions and refreshes kept in step
with the declarations, and one runner for `kb ingest` and Dagster."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import dagster as dg
import psycopg
from click.testing import CliRunner

from assets.automation import due_refreshes, scheduled_refresh_sensor, source_partitions
from assets.ingestion import ingest_flow
from assets.partitions import SOURCES
from assets.resources import KnowledgeBase
from pipelines.cli import main
from pipelines.settings import SAMPLES_DIR
from pipelines.sources.declarations import declare
from pipelines.storage.database import connect


def kb(*args: str, expect: int = 0):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result


def kb_json(*args: str):
    return json.loads(kb(*args, "--json").stdout)


def test_cli_declarations_are_audited_and_remove_soft_deletes(settings, samples_copy):
    kb("source", "add", "handbook", str(samples_copy), "--include", "handbook/*", "--group", "hr")
    assert kb_json("source", "list") == [{"source_id": "handbook", "kind": "folder", "location": str(samples_copy),
                                          "include": ["handbook/*"], "exclude": [], "groups": ["hr"],
                                          "freshness_hours": None, "refresh_cron": None,
                                          "allow_outside_links": False, "max_deletion_share": 0.5,
                                          "declared_in": None, "golden_set": None}]
    kb("ingest", "--source", "handbook")
    kb("source", "update", "handbook", "--group", "hr", "--group", "legal", "--freshness-hours", "12")
    bad_cron = kb("source", "update", "handbook", "--refresh-cron", "every morning", expect=2)
    assert "not a cron expression of five fields" in bad_cron.output

    shown = kb_json("source", "show", "handbook")
    assert shown["source"]["groups"] == ["hr", "legal"] and shown["source"]["freshness_hours"] == 12
    changes = shown["changes"]
    assert [c["action"] for c in changes] == ["update", "add"]
    assert changes[0]["before"]["groups"] == ["hr"] and changes[0]["after"]["groups"] == ["hr", "legal"]
    assert "kb source update" in changes[0]["actor"] and changes[0]["db_user"]

    removed = kb_json("source", "remove", "handbook")
    assert removed["documents_deleted"] == 1
    assert kb_json("source", "list") == []
    kb("ingest", "--source", "handbook", expect=2)
    with connect(settings) as conn:
        assert conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NULL").fetchone()[0] == 0
        events = conn.execute("SELECT event FROM document_versions ORDER BY recorded_at").fetchall()
        assert [e[0] for e in events] == ["published", "deleted"]  # history kept
    kb("source", "add", "handbook", str(samples_copy), "--include", "handbook/*", "--group", "hr")
    restored = kb_json("ingest", "--source", "handbook")
    assert restored["documents_published"] == 1 and restored["embeddings_computed"] == 0  # vectors from history


def test_a_config_file_declares_sources_and_owns_them(settings, tmp_path):
    config = tmp_path / "kb.toml"
    config.write_text(f"""
[sources.samples]
location = "{SAMPLES_DIR / 'docs'}"
exclude = ["sales/*"]
public = true

[sources.faq]
location = "{SAMPLES_DIR / 'faq.jsonl'}"
groups = ["staff"]
refresh_cron = "15 6 * * 1-5"
""")
    applied = kb_json("source", "apply", str(config))
    assert applied == {"added": ["samples", "faq"], "updated": [], "unchanged": [], "removed": [], "not_in_file": [],
                       "refreshes": applied["refreshes"]}
    assert {name: plan["cron"] for name, plan in applied["refreshes"].items()} == {
        "faq": "15 6 * * 1-5", "samples": "0 * * * *"}  # what will run when
    assert kb_json("source", "apply", str(config))["unchanged"] == ["samples", "faq"]
    refused = kb("source", "update", "faq", "--public", expect=2)
    assert f"declared in {config}" in refused.output
    kb("source", "remove", "faq", expect=2)

    config.write_text(f"""
[sources.faq]
location = "{SAMPLES_DIR / 'faq.jsonl'}"
groups = ["staff", "contractors"]
""")
    result = kb_json("source", "apply", str(config))
    assert result["updated"] == ["faq"] and result["not_in_file"] == ["samples"]
    assert kb_json("source", "apply", str(config), "--prune")["removed"] == ["samples"]
    assert [s["source_id"] for s in kb_json("source", "list")] == ["faq"]
    faq_changes = kb_json("source", "show", "faq")["changes"]
    assert faq_changes[0]["after"]["groups"] == ["contractors", "staff"] and str(config) in faq_changes[0]["actor"]

    bad = tmp_path / "bad.toml"
    bad.write_text('[sources.x]\nlocation = "nowhere"\ngroup = ["typo"]\n')
    assert "unknown keys group; known:" in kb("source", "apply", str(bad), expect=2).output


def test_a_file_path_is_not_a_source(settings):
    result = kb("ingest", str(SAMPLES_DIR / "docs" / "handbook" / "leave-policy.md"), expect=2)
    assert "not a single file" in result.output


def test_dagster_partitions_follow_the_declarations(settings, instance):
    resources = {"kb": KnowledgeBase()}
    kb("source", "add", "faq", str(SAMPLES_DIR / "faq.jsonl"), "--public")  # DAGSTER_HOME is the test instance: synced at once
    assert instance.get_dynamic_partitions(SOURCES) == ["faq"]

    with connect(settings) as conn:  # a declaration made behind the CLI's back is picked up by the sensor
        conn.execute("INSERT INTO sources (source_id, kind, location) VALUES ('tickets', 'jsonl', %s)",
                     (str(SAMPLES_DIR / "faq.jsonl"),))
        conn.execute("UPDATE sources SET removed_at = now() WHERE source_id = 'faq'")
    result = source_partitions(dg.build_sensor_context(instance=instance, resources=resources))
    requests = {type(r).__name__: list(r.partition_keys) for r in result.dynamic_partitions_requests}
    assert requests == {"AddDynamicPartitionsRequest": ["tickets"], "DeleteDynamicPartitionsRequest": ["faq"]}


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=timezone.utc)


def test_a_cron_is_due_in_the_first_tick_at_or_after_it_fires():
    """What is due is decided from the two times given, never the wall clock: each source's own cron (else the
    default), fired after the last tick and at or before this one, at the first time it fired."""
    declared = [declare("faq", SAMPLES_DIR / "faq.jsonl", refresh_cron="0 6 * * *"),
                declare("samples", SAMPLES_DIR / "docs"),  # the default: hourly
                declare("new-year", SAMPLES_DIR / "docs", refresh_cron="0 0 1 1 *")]

    def due(last: str, now: str) -> dict:
        return {source_id: (cron, fired) for source_id, cron, fired in
                due_refreshes(declared, "0 * * * *", utc(last), utc(now))}

    assert due("2026-03-16T05:01", "2026-03-16T05:59") == {}
    assert due("2026-03-16T05:30", "2026-03-16T06:30") == {"faq": ("0 6 * * *", utc("2026-03-16T06:00")),
                                                           "samples": ("0 * * * *", utc("2026-03-16T06:00"))}
    assert due("2026-03-16T06:30", "2026-03-16T07:30") == {"samples": ("0 * * * *", utc("2026-03-16T07:00"))}
    assert due("2026-03-16T05:59:30", "2026-03-16T06:00").keys() == {"faq", "samples"}  # due at the very second
    assert due("2026-03-16T06:00", "2026-03-16T06:59:59") == {}  # fired at the last tick: not due again
    assert due("2026-03-16T23:59", "2026-03-17T00:01").keys() == {"samples"}  # across midnight
    assert due("2026-12-31T23:59", "2027-01-01T00:00:30") == {"samples": ("0 * * * *", utc("2027-01-01T00:00")),
                                                              "new-year": ("0 0 1 1 *", utc("2027-01-01T00:00"))}
    assert due("2026-01-31T05:00", "2026-02-01T07:00") == {  # a day missed, over a month end: each asked once
        "faq": ("0 6 * * *", utc("2026-01-31T06:00")), "samples": ("0 * * * *", utc("2026-01-31T06:00"))}


def test_scheduled_refresh_follows_each_sources_own_cron(settings, instance):
    """The sensor Dagster runs, on a clock the test sets: a tick requests each source whose own cron fired since
    the last tick, whatever the time of day the suite runs."""
    kb("source", "add", "faq", str(SAMPLES_DIR / "faq.jsonl"), "--public", "--refresh-cron", "0 6 * * *")
    kb("source", "add", "samples", str(SAMPLES_DIR / "docs"), "--public")  # default KB_REFRESH_CRON: hourly
    instance.add_dynamic_partitions(SOURCES, ["faq", "samples"])
    resources, cursor = {"kb": KnowledgeBase()}, None

    def tick(now: str) -> dict:
        nonlocal cursor
        context = dg.build_sensor_context(instance=instance, resources=resources, cursor=cursor)
        requests = scheduled_refresh_sensor(clock=lambda: utc(now))(context)
        cursor = context.cursor
        assert cursor == utc(now).isoformat()  # the next tick counts from this one's time
        return {r.partition_key: r.run_key for r in requests}

    assert tick("2026-03-16T05:30") == {}  # the first tick only notes the time
    assert tick("2026-03-16T05:59") == {}
    assert tick("2026-03-16T06:30") == {"faq": "faq:cron:2026-03-16T06:00:00+00:00",
                                        "samples": "samples:cron:2026-03-16T06:00:00+00:00"}
    assert tick("2026-03-16T06:31") == {}  # each fire asks once
    assert tick("2026-03-16T07:30") == {"samples": "samples:cron:2026-03-16T07:00:00+00:00"}
    assert tick("2026-03-16T23:59") == {"samples": "samples:cron:2026-03-16T08:00:00+00:00"}  # the first missed
    assert tick("2026-03-17T00:00:30") == {"samples": "samples:cron:2026-03-17T00:00:00+00:00"}  # past midnight
    assert tick("2026-03-31T23:59") == {"faq": "faq:cron:2026-03-17T06:00:00+00:00",
                                        "samples": "samples:cron:2026-03-17T01:00:00+00:00"}
    assert tick("2026-04-01T06:00") == {"faq": "faq:cron:2026-04-01T06:00:00+00:00",  # into a new month
                                        "samples": "samples:cron:2026-04-01T00:00:00+00:00"}


TABLES = {  # content of every table an ingest writes, without ids and times that differ between databases
    "documents": "SELECT source_id, locator, doc_format, size_bytes, content_hash, title, metadata, parsed_hash,"
                 " published_key, deleted_at IS NULL, doc_date FROM documents",
    "elements": "SELECT d.locator, e.seq, e.category, e.text, e.depth, e.page_number, e.section_path, e.text_as_html"
                " FROM elements e JOIN documents d USING (document_id)",
    "chunks": "SELECT d.locator, c.ordinal, c.kind, c.text, c.embed_text, c.text_hash, c.section_path, c.page_number,"
              " c.token_count, c.entities, c.chunker_version, c.enrich_version, c.valid_to IS NULL"
              " FROM chunks c JOIN documents d USING (document_id)",
    "versions": "SELECT d.locator, v.version, v.event, v.content_hash, v.chunks_added, v.chunks_closed, v.chunks_kept"
                " FROM document_versions v JOIN documents d USING (document_id)",
    "postings": "SELECT t.term, d.locator, c.ordinal, p.tf, p.length, c.valid_to IS NULL FROM lexical_postings_any p"
                " JOIN lexical_terms t USING (term_key) JOIN chunks c USING (chunk_id) JOIN documents d USING (document_id)",
    "terms": "SELECT term, df FROM lexical_terms",
    "stats": "SELECT chunks, total_length FROM lexical_stats",
    "models": "SELECT model_key, dimensions, vector_table, state FROM embedding_models",
    "drafts": "SELECT document_id FROM chunk_drafts",
    "failures": "SELECT source_id, locator, stage, reason FROM failures",
    "run": "SELECT sources, counters - 'elapsed_s', finished_at IS NOT NULL FROM ingest_runs",
}


def _store(url: str) -> dict:
    with psycopg.connect(url) as conn:
        rows = {name: sorted(map(repr, conn.execute(query).fetchall())) for name, query in TABLES.items()}
        table = conn.execute("SELECT vector_table FROM embedding_models").fetchone()[0]
        rows["vectors"] = sorted(map(repr, conn.execute(f"SELECT text_hash, embedding::text FROM {table}").fetchall()))
    return rows


def test_kb_ingest_and_a_dagster_materialization_leave_identical_stores(settings, server_url, instance, samples_copy,
                                                                        monkeypatch):
    (samples_copy / "broken.pdf").write_bytes(b"%PDF-1.4 not really")  # failures are part of the record too
    kb("source", "add", "samples", str(samples_copy), "--public")
    kb("ingest", "--source", "samples", expect=3)
    by_cli = _store(settings.database_url)

    second = "kb_test_dagster_" + settings.database_url.rsplit("kb_test_", 1)[1].split()[0][:8]
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {second}")
    info = psycopg.conninfo.conninfo_to_dict(settings.database_url)
    info["dbname"] = second
    monkeypatch.setenv("DATABASE_URL", psycopg.conninfo.make_conninfo(**info))
    try:
        kb("source", "add", "samples", str(samples_copy), "--public")
        result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples")
        assert result.success
        by_dagster = _store(psycopg.conninfo.make_conninfo(**info))
        status = kb_json("status")
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {second} WITH (FORCE)")
    assert by_dagster == by_cli
    assert status["last_run"]["started_by"] == "dagster" and status["last_run"]["external_run_id"] == result.run_id
    assert status["last_run"]["counters"]["documents_failed"] == 1


def test_the_same_kb_toml_applies_from_another_checkout_and_paths_stay_relative(settings, tmp_path):
    """A kb.toml kept in git, applied from a second checkout (another folder, another host): accepted as the same
    declaration, its relative paths stay relative and now resolve there; documents keep their history."""
    import shutil

    first = tmp_path / "checkout-a"
    (first / "docs").mkdir(parents=True)
    (first / "docs" / "policy.md").write_text("# Policy\n\nThe okapi policy.\n")
    (first / "golden.jsonl").write_text('{"query": "okapi policy", "document": "policy.md"}\n')
    (first / "kb.toml").write_text('[sources.team]\nlocation = "docs"\ngolden_set = "golden.jsonl"\npublic = true\n')
    assert kb_json("source", "apply", str(first / "kb.toml"))["added"] == ["team"]
    assert kb_json("source", "show", "team")["source"]["location"] == "docs"
    kb("ingest", "--source", "team")

    second = tmp_path / "checkout-b"
    shutil.copytree(first, second)
    shutil.rmtree(first)  # the first checkout is gone: only the second one holds the documents now
    result = kb_json("source", "apply", str(second / "kb.toml"))
    assert result["updated"] == ["team"] and result["refreshes"]["team"]["cron"] == "0 * * * *"
    declared = kb_json("source", "show", "team")
    assert (declared["source"]["location"], declared["source"]["golden_set"]) == ("docs", "golden.jsonl")
    assert declared["source"]["declared_in"] == str(second / "kb.toml")
    again = kb_json("ingest", "--source", "team")
    assert again["documents_unchanged"] == 1 and again["documents_deleted"] == 0 and not again["errors"]

    # A source declared from the CLI is still never taken over by a file.
    (second / "notes").mkdir()
    kb("source", "add", "cli-made", str(second / "notes"), "--public")
    (second / "other.toml").write_text('[sources.cli-made]\nlocation = "notes"\npublic = true\n')
    assert "already declared from the CLI" in kb("source", "apply", str(second / "other.toml"), expect=2).output


def test_kb_eval_never_changes_a_source_declared_in_the_database_it_is_given(settings, tmp_path):
    import shutil

    from pipelines.settings import REPO_ROOT

    dataset = tmp_path / "scifact"
    (dataset / "qrels").mkdir(parents=True)
    corpus = REPO_ROOT.parent / "shared" / "datasets" / "scifact"
    (dataset / "corpus.jsonl").write_text("".join(open(corpus / "corpus.jsonl").readlines()[:20]))
    (dataset / "queries.jsonl").write_text("".join(open(corpus / "queries.jsonl").readlines()[:3]))
    (dataset / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n")
    moved = tmp_path / "elsewhere"
    shutil.copytree(dataset, moved)
    kb("source", "add", "beir-scifact", str(moved / "corpus.jsonl"), "--public")
    refused = kb("eval", str(dataset), "--database-url", settings.database_url, expect=2)
    assert "never changes a declared source" in refused.output
    assert kb_json("source", "show", "beir-scifact")["source"]["location"] == str(moved / "corpus.jsonl")


def test_declarations_cannot_widen_access_by_accident(settings, tmp_path):
    """Each way a declaration silently widened who may read documents is refused, saying what to write instead."""
    share = tmp_path / "share"
    (share / "hr" / "drafts").mkdir(parents=True)
    (share / "hr" / "salaries.md").write_text("# Salaries\n\nThe zebra salary band.\n")
    (share / "hr" / "drafts" / "reorg.md").write_text("# Reorg\n\nConfidential zebra reorg.\n")
    (share / "public.md").write_text("# Welcome\n\nThe okapi welcome page.\n")
    config = tmp_path / "kb.toml"

    def apply(text: str, expect: int = 0):
        config.write_text(text)
        return kb("source", "apply", str(config), expect=expect).output

    assert "empty group list" in apply('[sources.hr]\nlocation = "share/hr"\ngroups = []\n', expect=2)
    assert "exactly one of them" in apply('[sources.hr]\nlocation = "share/hr"\n', expect=2)  # who reads it, said
    assert "not 'drafts/*'" in apply('[sources.hr]\nlocation = "share/hr"\ngroups = ["hr"]\nexclude = "drafts/*"\n',
                                     expect=2)
    apply('[sources.hr]\nlocation = "share/hr"\ngroups = ["hr"]\nexclude = ["drafts/*"]\n')
    assert "one folder is one source" in kb("source", "add", "hr-again", str(share / "hr"), "--public",
                                             expect=2).output
    kb("source", "add", "everything", str(share), "--public")  # a public parent: it skips hr's folder
    assert "may not be readable by more" in kb("source", "add", "hr-drafts", str(share / "hr" / "drafts"),
                                                "--public", expect=2).output
    assert "say who may read" in kb("source", "add", "x", str(share / "hr" / "drafts"), expect=2).output
    kb("ingest")
    public = {c["document"] for c in kb_json("search", "zebra salary reorg", "--k", "10")["chunks"]}
    assert public <= {"public.md"}  # nothing of hr reaches a public caller, through either source
    assert {c["document"] for c in kb_json("search", "okapi welcome", "--k", "10")["chunks"]} == {"public.md"}
    hr = {c["document"] for c in kb_json("search", "zebra salary reorg", "--group", "hr", "--k", "10")["chunks"]}
    assert "salaries.md" in hr and not any("reorg" in d for d in hr)  # the excluded drafts are not ingested

    # Removed, then declared again by `kb ingest PATH` without saying who may read it: refused, not public.
    apply('[sources.other]\nlocation = "share/hr/drafts"\ngroups = ["hr"]\n')
    kb("source", "apply", str(config), "--prune")
    refused = kb("ingest", str(share / "hr"), "--source", "hr", expect=2).output
    assert "needs to say who may read it: add --group G (repeatable) or --public" in refused
