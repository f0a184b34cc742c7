"""The migration runner against a real PostgreSQL."""

import shutil

import numpy as np
import psycopg
import pytest

from pipelines.retrieval.search import search
from pipelines.settings import SQL_DIR
from pipelines.storage.database import connect
from pipelines.storage.migrations import migrate, migration_files


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


def _migrations_through(tmp_path, last: int):
    """A copy of sql/ without the migrations after `last` (today's function files apply to either schema)."""
    old = tmp_path / "sql"
    shutil.copytree(SQL_DIR, old)
    for version, path in migration_files(old):
        if version > last:
            path.unlink()
    return old


def test_lean_storage_migrates_a_database_built_before_it_in_place(settings, tmp_path):
    """sql/013: an existing knowledge base keeps its chunks, postings and vectors, now in half the bytes, and keeps
    answering searches; its vectors become halfvec with a halfvec HNSW index, and chunks written afterwards are
    indexed for BM25 without the dropped tsvector column."""
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        migrate(raw, _migrations_through(tmp_path, 12))
        raw.execute("INSERT INTO sources (source_id, kind, location) VALUES ('s', 'folder', '/s')")
        document = raw.execute("INSERT INTO documents (source_id, locator, doc_format, size_bytes, content_hash)"
                               " VALUES ('s', 'a.txt', 'txt', 1, 'h') RETURNING document_id").fetchone()[0]
        chunks = {"old": ("An old encoder note", "2025-01-01"), "cable": ("Encoder cable HR-2024-047 replaced", None),
                  "belt": ("The drive belt was replaced twice", None)}
        for ordinal, (text_hash, (text, closed)) in enumerate(chunks.items()):
            raw.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_text, text_hash, section_path,"
                        " token_count, chunker_version, enrich_version, valid_to)"
                        " VALUES (%s, %s, 'text', %s, %s, %s, '{}', 5, 'c', 'e', %s)",
                        (document, ordinal, text, f"Manual\n\n{text}", text_hash, closed))
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

        assert migrate(raw) == ["013_lean_storage.sql"]
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
        conn.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_text, text_hash, section_path,"
                     " token_count, chunker_version, enrich_version) VALUES (%s, 3, 'text', 'A new gearbox',"
                     " 'Manual\n\nA new gearbox', 'gear', '{}', 4, 'c', 'e')", (document,))
        assert conn.execute("SELECT term, tf, live, in_body FROM lexical_postings p JOIN chunks c USING (chunk_id)"
                            " WHERE c.text_hash = 'gear' ORDER BY term").fetchall() == [
            ("gearbox", 1, True, True), ("manual", 1, True, False), ("new", 1, True, True)]
        hits = search(conn, None, "gearbox", 1, arm="lexical", vector=query, model_key="old:4")
        assert [h.content for h in hits] == ["A new gearbox"]
