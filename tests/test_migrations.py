"""The migration runner against a real PostgreSQL."""

import shutil
from pathlib import Path

import numpy as np
import psycopg
import pytest

from pipelines.retrieval.search import search
from pipelines.settings import SQL_DIR
from pipelines.storage.database import connect
from pipelines.storage.migrations import migrate, migration_files
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
        chunks = "SELECT chunk_id, text, embed_text, lexical_length, valid_to FROM chunks ORDER BY 1"
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
