"""The migration runner against a real PostgreSQL."""

import shutil

import pytest

from pipelines.settings import SQL_DIR
from pipelines.storage.migrations import migrate


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
