"""The migration runner against a real PostgreSQL."""

import json
import shutil
from pathlib import Path

import numpy as np
import psycopg
import pytest

from pipelines.retrieval.search import search
from pipelines.settings import SQL_DIR
from pipelines.storage.database import DatabaseUnavailable, SchemaNotReady, connect
from pipelines.storage.migrations import (
    SchemaFile,
    duration,
    estimate,
    is_installed,
    migrate,
    migration_files,
    pending,
)
from pipelines.storage.vectors import ensure_vector_store


def test_migrations_are_recorded_and_a_second_run_applies_nothing(conn):
    # The `conn` fixture already migrated this fresh database once.
    applied = conn.execute("SELECT name FROM kb_schema_migrations ORDER BY version").fetchall()
    assert [r[0] for r in applied] == sorted(p.name for p in SQL_DIR.glob("*.sql"))
    assert migrate(conn) == []
    tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"sources", "documents", "elements", "chunk_drafts", "chunks", "embedding_models"} <= tables


def test_an_edited_applied_migration_is_refused(conn, tmp_path):
    edited = tmp_path / "sql"
    shutil.copytree(SQL_DIR, edited)
    first = sorted(edited.glob("001_*.sql"))[0]
    first.write_text(first.read_text() + "\n-- edited\n")
    with pytest.raises(RuntimeError, match="changed after it was applied"):
        migrate(conn, edited)


POSTINGS = "SELECT term, chunk_id, tf, length, live, source_key, in_body FROM lexical_postings ORDER BY 1, 2"
# The postings of sql/014 on, in the same shape (live: which table holds them; in body: lexemes of the chunk's text).
POSTINGS_014 = """
SELECT t.term, p.chunk_id, p.tf, p.length, p.live, t.source_key,
       t.term = ANY(tsvector_to_array(kb_lexemes(c.text))) AS in_body
FROM (SELECT *, true AS live FROM lexical_postings UNION ALL SELECT *, false FROM lexical_postings_closed) p
JOIN lexical_terms t USING (term_key) JOIN chunks c USING (chunk_id)
ORDER BY 1, 2
"""
# Counted terms (from sql/014, a term only closed chunks hold also has a row, counting nothing: its postings need a key)
TERMS = "SELECT term, source_key, df, postings FROM lexical_terms WHERE postings > 0 ORDER BY 1, 2"
# The BM25 trigger functions as they were before sql/014, which changed the postings they write, and before sql/015,
# which added the statistics' history they keep.
FUNCTIONS_BEFORE_014 = Path(__file__).parent / "data" / "lexical_functions_before_014.sql"
FUNCTIONS_BEFORE_015 = Path(__file__).parent / "data" / "lexical_functions_before_015.sql"


def _migrations_through(tmp_path, last: int):
    """A copy of sql/ without the migrations after `last`, with the function files of that schema."""
    old = tmp_path / f"sql-{last}"
    shutil.copytree(SQL_DIR, old)
    for version, path in migration_files(old):
        if version > last:
            path.unlink()
    if last < 15:
        shutil.copy(FUNCTIONS_BEFORE_014 if last < 14 else FUNCTIONS_BEFORE_015, old / "functions" / "lexical.sql")
        (old / "functions" / "sources.sql").unlink()
    return old


# Three chunks of one document as an older kb wrote them (embed_text stored): one closed, two live.
OLD_CHUNKS = {"old": ("An old encoder note", "2025-01-01"), "cable": ("Encoder cable HR-2024-047 replaced", None),
              "belt": ("The drive belt was replaced twice", None)}


def _old_document(raw: psycopg.Connection, prefix: str) -> int:
    """A source, a document and OLD_CHUNKS, each embedded as `prefix` + its text; returns the document id."""
    raw.execute("INSERT INTO sources (source_id, kind, location) VALUES ('s', 'folder', '/s')")
    document = raw.execute("INSERT INTO documents (source_id, locator, doc_format, size_bytes, content_hash)"
                           " VALUES ('s', 'a.txt', 'txt', 1, 'h') RETURNING document_id").fetchone()[0]
    for ordinal, (text_hash, (text, closed)) in enumerate(OLD_CHUNKS.items()):
        raw.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_text, text_hash, section_path,"
                    " token_count, chunker_version, enrich_version, valid_to)"
                    " VALUES (%s, %s, 'text', %s, %s, %s, '{}', 5, 'c', 'e', %s)",
                    (document, ordinal, text, prefix + text, text_hash, closed))
    return document


def test_lean_storage_migrates_a_database_built_before_it_in_place(settings, tmp_path):
    """sql/013: an existing knowledge base keeps its chunks, postings and vectors, now in half the bytes, and keeps
    answering searches; its vectors become halfvec with a halfvec HNSW index, and chunks written afterwards are
    indexed for BM25 without the dropped tsvector column."""
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        migrate(raw, _migrations_through(tmp_path, 12))
        document = _old_document(raw, "Manual\n\n")
        # The vector table and index as sql/templates made them before sql/013.
        raw.execute("CREATE TABLE vectors_old_4 (text_hash text PRIMARY KEY, embedding vector(4) NOT NULL)")
        raw.execute("CREATE INDEX vectors_old_4_hnsw ON vectors_old_4 USING hnsw (embedding vector_cosine_ops)")
        raw.execute("INSERT INTO embedding_models (model_key, dimensions, vector_table, state)"
                    " VALUES ('old:4', 4, 'vectors_old_4', 'active')")
        vectors = {"old": "[1,0,0,0]", "cable": "[0.5,0.75,0,0]", "belt": "[0,0,1,0]"}  # exact in half precision
        for text_hash, vector in vectors.items():
            raw.execute("INSERT INTO vectors_old_4 VALUES (%s, %s::vector)", (text_hash, vector))
        postings = raw.execute(POSTINGS).fetchall()
        size = "SELECT pg_column_size(embedding) FROM vectors_old_4 LIMIT 1"
        assert raw.execute(size).fetchone()[0] == 5 + 4 * 4  # a 5-byte header, then 4 bytes a dimension

        assert migrate(raw, _migrations_through(tmp_path, 13)) == ["013_lean_storage.sql"]
        assert raw.execute(POSTINGS).fetchall() == postings, "every posting kept, live and closed"
        assert raw.execute("SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid ="
                           " 'vectors_old_4'::regclass AND attname = 'embedding'").fetchone()[0] == "halfvec(4)"
        assert dict(raw.execute("SELECT text_hash, embedding::vector::text FROM vectors_old_4").fetchall()) == vectors
        assert raw.execute(size).fetchone()[0] == 5 + 4 * 2, "2 bytes a dimension"
        index = raw.execute("SELECT indexdef FROM pg_indexes WHERE indexname = 'vectors_old_4_hnsw'").fetchone()[0]
        assert "halfvec_cosine_ops" in index
        assert raw.execute("SELECT count(*) FROM pg_attribute WHERE attrelid = 'chunks'::regclass"
                           " AND attname = 'search_tsv'").fetchone()[0] == 0
        assert raw.execute("SELECT count(*) FROM chunks").fetchone()[0] == 3
        migrate(raw)  # the rest, as `kb migrate` would: connect() never upgrades a schema

    with connect(settings) as conn:
        query = np.array([0.5, 0.75, 0, 0], dtype=np.float32)
        with conn.transaction():  # the dense arm reads the converted HNSW index
            conn.execute("SET LOCAL enable_seqscan = off")
            dense = search(conn, None, "drive", 2, arm="dense", vector=query, model_key="old:4")
        assert [h.content for h in dense] == ["Encoder cable HR-2024-047 replaced", "The drive belt was replaced twice"]
        assert [h.content for h in search(conn, None, "HR-2024-047 cable", 1, arm="lexical", vector=query,
                                       model_key="old:4")] == ["Encoder cable HR-2024-047 replaced"]
        conn.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_prefix, text_hash, section_path,"
                     " token_count, chunker_version, enrich_version) VALUES (%s, 3, 'text', 'A new gearbox',"
                     " 'Manual\n\n', 'gear', '{}', 4, 'c', 'e')", (document,))
        assert conn.execute(f"SELECT term, tf, live, in_body FROM ({POSTINGS_014}) p WHERE chunk_id ="
                            " (SELECT chunk_id FROM chunks WHERE text_hash = 'gear') ORDER BY term").fetchall() == [
            ("gearbox", 1, True, True), ("manual", 1, True, False), ("new", 1, True, True)]
        hits = search(conn, None, "gearbox", 1, arm="lexical", vector=query, model_key="old:4")
        assert [h.content for h in hits] == ["A new gearbox"]


def test_compact_postings_migrate_a_database_built_before_them_in_place(settings, tmp_path):
    """sql/014: every posting, live and closed, keeps its term, chunk, tf and length, now keyed by term_key in the
    table of its chunk's state; term statistics and lengths are unchanged; chunks keep their embedded text, now
    computed from a stored prefix; document frequencies count the words of each chunk's text as it is now. A chunk
    whose embedded text does not end with its text stops the migration before anything changes."""
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        migrate(raw, _migrations_through(tmp_path, 13))
        document = _old_document(raw, "Drive manual\nEncoders\n\n")
        # Publish kept a chunk whose embedded text split differently: "encoder" is no longer in its own text, but
        # its posting still counted it for document frequency.
        raw.execute("UPDATE chunks SET text = 'cable HR-2024-047 replaced' WHERE text_hash = 'cable'")
        chunks = "SELECT chunk_id, text, embed_text, kb_lexical_length(embed_text), valid_to FROM chunks ORDER BY 1"
        before = {"postings": raw.execute(POSTINGS).fetchall(), "chunks": raw.execute(chunks).fetchall(),
                  "terms": raw.execute(TERMS).fetchall(),
                  "stats": raw.execute("SELECT * FROM lexical_stats").fetchall()}
        assert {live for *_, live, _, _ in before["postings"]} == {True, False}

        odd = raw.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_text, text_hash, section_path,"
                          " token_count, chunker_version, enrich_version) VALUES (%s, 9, 'text', 'a belt',"
                          " 'not the text', 'odd', '{}', 2, 'c', 'e') RETURNING chunk_id", (document,)).fetchone()[0]
        with pytest.raises(psycopg.errors.RaiseException, match="1 chunks have an embed_text that does not end"):
            migrate(raw)
        assert raw.execute(POSTINGS).fetchall() != before["postings"], "the odd chunk's postings are still there"
        raw.execute("DELETE FROM chunks WHERE chunk_id = %s", (odd,))
        assert raw.execute(POSTINGS).fetchall() == before["postings"], "nothing changed by the refused migration"

        applied = migrate(raw)
        assert applied[0] == "014_compact_postings.sql" and "functions/lexical.sql" in applied
        without_in_body = [row[:6] for row in before["postings"]]
        assert [row[:6] for row in raw.execute(POSTINGS_014)] == without_in_body
        assert raw.execute(chunks).fetchall() == before["chunks"]
        assert ("encod", 1, 1, 2) in before["terms"]
        assert raw.execute(TERMS).fetchall() == [(t, s, 0 if t == "encod" else df, n) for t, s, df, n in before["terms"]]
        assert raw.execute("SELECT * FROM lexical_stats").fetchall() == before["stats"]
        assert raw.execute("SELECT embed_prefix FROM chunks WHERE text_hash = 'belt'").fetchone()[0] == \
            "Drive manual\nEncoders\n\n"

        # Closing a chunk moves its postings and takes it out of the statistics; the search finds the live one.
        raw.execute("UPDATE chunks SET valid_to = now() WHERE text_hash = 'belt'")
        assert raw.execute("SELECT df, postings FROM lexical_terms WHERE term = 'belt'").fetchone() == (0, 0)
        where = "FROM {} p JOIN chunks c USING (chunk_id) WHERE c.text_hash = 'belt'"
        assert raw.execute("SELECT count(*) " + where.format("lexical_postings")).fetchone()[0] == 0
        assert raw.execute("SELECT count(*) " + where.format("lexical_postings_closed")).fetchone()[0] == 6, \
            "drive manual encod belt replac twice"
    with connect(settings) as conn:
        ensure_vector_store(conn, "none:4", 4)
        hits = search(conn, None, "encoder cable", 1, arm="lexical", vector=np.zeros(4, dtype=np.float32),
                      model_key="none:4")
        assert [h.content for h in hits] == ["cable HR-2024-047 replaced"]
        conn.execute("UPDATE chunks SET valid_to = now() WHERE text_hash = 'cable'")
        assert conn.execute("SELECT df, postings FROM lexical_terms WHERE term = 'encod'").fetchone() == (0, 0)


def test_declarations_and_statistics_history_migrate_a_database_built_before_them(settings, tmp_path):
    """sql/015: a removed source is renamed so its name is free and its history keeps its readers; the statistics'
    history is rebuilt from the chunks' validity, so that summed up to any time it gives the statistics of the
    chunks valid then, and summed up to now the live ones."""
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        migrate(raw, _migrations_through(tmp_path, 14))
        for name, removed in (("kept", False), ("gone", True)):
            raw.execute("INSERT INTO sources (source_id, kind, location, removed_at) VALUES (%s, 'folder', '/x', %s)",
                        (name, "2026-01-01" if removed else None))
            document = raw.execute("INSERT INTO documents (source_id, locator, doc_format, size_bytes, content_hash)"
                                   " VALUES (%s, 'a.md', 'md', 1, 'h') RETURNING document_id", (name,)).fetchone()[0]
            for ordinal, (text, valid_from, valid_to) in enumerate((
                    ("Encoder cable replaced", "2026-01-01", "2026-03-01"),
                    ("Encoder belt checked twice", "2026-02-01", None),
                    ("Drive belt encoder manual", "2026-04-01", None))):
                raw.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_prefix, text_hash,"
                            " section_path, token_count, chunker_version, enrich_version, valid_from, valid_to)"
                            " VALUES (%s, %s, 'text', %s, 'Manual\n\n', %s, '{}', 4, 'c', 'e', %s, %s)",
                            (document, ordinal, text, f"{name}{ordinal}", valid_from, valid_to))
        live_terms = raw.execute("SELECT term_key, df, postings FROM lexical_terms ORDER BY 1").fetchall()
        live_stats = raw.execute("SELECT source_key, chunks, total_length FROM lexical_stats ORDER BY 1").fetchall()
        assert "015_declarations_decide_access.sql" in migrate(raw)

        assert [r[0] for r in raw.execute("SELECT source_id FROM sources ORDER BY source_key")] == ["kept", "gone~2"]
        assert raw.execute("SELECT count(*) FROM documents WHERE source_id = 'gone~2'").fetchone()[0] == 1
        summed = raw.execute("SELECT t.term_key, coalesce(sum(h.df), 0), coalesce(sum(h.postings), 0)"
                             " FROM lexical_terms t LEFT JOIN lexical_terms_history h USING (term_key)"
                             " GROUP BY 1 ORDER BY 1").fetchall()
        assert summed == live_terms
        assert raw.execute("SELECT source_key, sum(chunks), sum(total_length) FROM lexical_stats_history"
                           " GROUP BY 1 ORDER BY 1").fetchall() == live_stats
        for when, valid in (("2026-01-15", 1), ("2026-02-15", 2), ("2026-03-15", 1), ("2026-05-01", 2)):
            chunks = raw.execute("SELECT sum(chunks) FROM lexical_stats_history WHERE source_key = 1"
                                 " AND changed_at <= %s", (when,)).fetchone()[0]
            encoder = raw.execute("SELECT sum(h.df) FROM lexical_terms_history h JOIN lexical_terms t USING (term_key)"
                                  " WHERE t.source_key = 1 AND t.term = 'encod' AND h.changed_at <= %s",
                                  (when,)).fetchone()[0]
            assert (chunks, encoder) == (valid, valid), when  # every chunk's own text holds "encoder"


# Issue 27 (13): schema changes are an explicit step. A connection never upgrades a schema (a migration may rebuild
# HNSW for minutes); serving never installs or migrates; `kb migrate` takes the lock, says what is pending and how
# long it will take, then applies each file in its own transaction.

def kb(*args: str):
    from click.testing import CliRunner

    from pipelines.cli import main

    return CliRunner().invoke(main, list(args))


def _behind(settings, tmp_path, last: int = 13) -> list[str]:
    """The database at migration `last`, as an older kb left it; returns the names a current kb still needs."""
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        migrate(raw, _migrations_through(tmp_path, last))
        return [item.name for item in pending(raw)]


def _applied(settings) -> list[int]:
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        return [row[0] for row in raw.execute("SELECT version FROM kb_schema_migrations ORDER BY version")]


def test_connect_on_a_behind_schema_raises_one_line_and_migrates_nothing(settings, tmp_path):
    todo = _behind(settings, tmp_path)
    assert todo[0] == "014_compact_postings.sql" and "functions/lexical.sql" in todo
    for install in (True, False):
        with pytest.raises(SchemaNotReady) as raised:
            with connect(settings, install=install):
                pass
        line = str(raised.value)
        assert "\n" not in line and "kb migrate" in line and all(name in line for name in todo), line
    assert isinstance(raised.value, DatabaseUnavailable)
    status = kb("status")
    assert status.exit_code == 2 and status.output.count("\n") == 1, status.output
    assert status.output.startswith("Error: kb's schema in") and "run `kb migrate`" in status.output
    assert _applied(settings)[-1] == 13, "nothing was migrated behind the operator's back"


def test_kb_migrate_says_what_is_pending_and_how_long_then_applies_each_file(settings, tmp_path):
    todo = _behind(settings, tmp_path)
    run = kb("migrate")
    assert run.exit_code == 0, run.output
    lines = run.output.splitlines()
    assert lines[0].startswith(f"{len(todo)} files pending in ") and all(name in lines[0] for name in todo)
    assert lines[1].startswith("estimate: ") and "bench/README.md" in lines[1]
    assert [line.split(" in ")[0] for line in lines[2:-1]] == [f"applied {name}" for name in todo]
    assert lines[-1].startswith("kb's schema in") and f"applied {len(todo)} files" in lines[-1]
    with connect(settings, install=False) as conn:
        assert pending(conn) == []
    again = kb("migrate", "--json")
    assert again.exit_code == 0 and json.loads(again.stdout)["applied"] == [] and again.stderr == ""
    assert "nothing to migrate" in kb("migrate").output


def test_kb_migrate_applies_each_file_in_its_own_transaction_and_names_the_one_that_failed(settings, tmp_path):
    _behind(settings, tmp_path, 12)
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        document = _old_document(raw, "Manual\n\n")  # a chunk sql/014 refuses: its embed_text does not end with it
        raw.execute("UPDATE chunks SET embed_text = 'not the text' WHERE document_id = %s AND ordinal = 0", (document,))
    run = kb("migrate", "--json")
    assert run.exit_code == 1
    error = run.stderr.strip().splitlines()[-1]
    assert error.startswith("Error: 014_compact_postings.sql failed:") and "files before it are applied" in error
    assert _applied(settings)[-1] == 13, "sql/013 committed on its own; nothing of sql/014 is"


def test_the_last_migration_commits_with_the_function_files(settings, tmp_path):
    """sql/021 drops a column the old trigger functions read: a function file that fails takes the migration with it,
    so that no write ever meets the new table with the old functions. The error names the file that failed."""
    _behind(settings, tmp_path, 20)
    broken = tmp_path / "sql-broken"
    shutil.copytree(SQL_DIR, broken)
    (broken / "functions" / "sources.sql").write_text("SELECT kb_no_such_function();")
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        with pytest.raises(psycopg.errors.UndefinedFunction) as failed:
            migrate(raw, broken)
        assert failed.value.failed_file == "functions/sources.sql"
        assert 21 not in _applied(settings)
        assert raw.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = 'chunks'"
                           " AND column_name = 'lexical_length'").fetchone() == (1,), "sql/021 was rolled back"
    assert kb("migrate").exit_code == 0 and _applied(settings)[-1] == 21


def test_kb_migrate_waits_for_the_lock_then_names_who_holds_it(settings):
    from pipelines.storage.migrations import _LOCK_ID

    with psycopg.connect(settings.database_url, autocommit=True, application_name="a long migration") as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
        run = kb("migrate", "--wait", "0.2")
        assert run.exit_code == 2 and run.output.count("\n") == 1, run.output
        holder_pid = holder.info.backend_pid
    assert f"held by PostgreSQL backend {holder_pid} (application 'a long migration'" in run.output
    assert "was not released within 0.2 s" in run.output
    assert kb("migrate").exit_code == 0, "the lock went with its session"


def test_a_brand_new_database_is_installed_by_the_cli_and_by_connect_but_never_by_serving(settings):
    with pytest.raises(SchemaNotReady, match="holds no kb schema yet: run `kb migrate` to install it"):
        with connect(settings, install=False):
            pass
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        assert not is_installed(raw), "the refused check created nothing"
    assert kb("status").exit_code == 0  # any command installs an empty schema: nothing to rebuild
    assert _applied(settings) == [version for version, _ in migration_files()]


def test_a_server_on_a_behind_schema_answers_503_with_the_line_until_kb_migrate_runs(settings, tmp_path):
    from fastapi.testclient import TestClient

    from pipelines.serving.api import create_app

    todo = _behind(settings, tmp_path)
    with TestClient(create_app(settings)) as client:
        requests = [client.get("/v1/knowledge/search", params={"q": "leave"}), client.get("/health"),
                    client.get("/v1/sources"), client.post("/v1/knowledge/answer", json={"question": "leave?"})]
        for response in requests:
            assert response.status_code == 503, response.text
            line = response.json()["detail"]
            assert "behind this version of kb" in line and "kb migrate" in line and todo[0] in line and "\n" not in line
        assert _applied(settings)[-1] == 13, "serving migrated nothing"
        assert kb("migrate").exit_code == 0
        searched = client.get("/v1/knowledge/search", params={"q": "leave"})
        assert searched.status_code == 409 and "kb ingest" in searched.json()["detail"], searched.text  # it serves


def test_a_server_on_a_brand_new_database_installs_nothing(settings):
    from fastapi.testclient import TestClient

    from pipelines.serving.api import create_app

    with TestClient(create_app(settings)) as client:
        for path in ("/v1/knowledge/search?q=leave", "/health"):
            response = client.get(path)
            assert response.status_code == 503 and "holds no kb schema yet" in response.json()["detail"], response.text
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        assert not is_installed(raw) and raw.execute("SELECT to_regclass('chunks')").fetchone()[0] is None


def test_a_migration_estimate_comes_from_what_its_file_touches(conn):
    ensure_vector_store(conn, "none:4", 4)
    conn.execute("INSERT INTO vectors_none_4 VALUES ('a', '[1,0,0,0]'), ('b', '[0,1,0,0]')")
    declared = SchemaFile("099_x.sql", "-- kb-migrate: rewrites chunks, lexical_postings; rebuilds hnsw\nSELECT 1;", 99)
    cost = estimate(conn, declared)
    assert set(cost.rewrites) == {"chunks", "lexical_postings"} and cost.hnsw_vectors == 2
    assert "rebuilds HNSW over 2 vectors" in cost.describe() and cost.seconds > 0
    inferred = estimate(conn, SchemaFile("013_lean_storage.sql", (SQL_DIR / "013_lean_storage.sql").read_text(), 13))
    assert {"chunks", "lexical_postings"} <= set(inferred.rewrites) and inferred.hnsw_vectors == 2
    assert estimate(conn, SchemaFile("functions/lexical.sql", "CREATE FUNCTION ...", None)).describe() == "nothing large"
    assert [duration(s) for s in (0.2, 40, 650, 9000)] == ["under a second", "about 40 s", "about 11 min",
                                                            "about 2.5 h"]


def test_the_dagster_migrate_job_upgrades_a_behind_schema(settings, tmp_path, instance):
    from assets.resources import KnowledgeBase
    from assets.schema import migrate_job

    todo = _behind(settings, tmp_path)
    result = migrate_job.execute_in_process(instance=instance, resources={"kb": KnowledgeBase()})
    assert result.success and result.output_for_node("kb_migrate_schema") == todo
    logged = [entry.user_message for entry in instance.all_logs(result.run_id)]
    assert any(message.startswith("estimate: ") for message in logged) and _applied(settings)[-1] == migration_files()[-1][0]


def test_the_lock_holder_named_is_the_one_in_this_database(settings, server_url):
    """PostgreSQL's advisory locks are per database: a `kb eval` migrating its own database on the same server holds
    kb's lock there too. The line named whichever holder pg_locks listed first, maybe that one."""
    import uuid

    from psycopg import sql

    from pipelines.storage.database import ensure_database
    from pipelines.storage.migrations import _LOCK_ID

    other = f"kb_other_{uuid.uuid4().hex[:12]}"
    url = ensure_database(server_url, other)
    try:
        with psycopg.connect(url, autocommit=True, application_name="kb eval elsewhere") as elsewhere, \
                psycopg.connect(settings.database_url, autocommit=True, application_name="a migration") as here:
            elsewhere.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
            here.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
            run = kb("migrate", "--wait", "0.2")
            assert run.exit_code == 2, run.output
            assert f"held by PostgreSQL backend {here.info.backend_pid} (application 'a migration'" in run.output
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(other)))


def test_a_migration_lock_held_too_long_is_one_line_for_every_command():
    """`kb eval` migrates its own databases and `kb ingest` installs a new one: a lock another run holds past the
    wait ends them with the line naming the holder, as it ends `kb migrate` (it was a generic error there)."""
    from pipelines.cli import _usage_problem
    from pipelines.storage.migrations import MigrationLockBusy

    line = "kb's migration lock is held by PostgreSQL backend 7 (...), and was not released within 60 s: ..."
    assert _usage_problem(MigrationLockBusy(line)) == line
