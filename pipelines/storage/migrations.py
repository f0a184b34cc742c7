"""A small migration runner: applies sql/NNN_*.sql in order, once each, and records what it applied; then
(re)applies sql/functions/*.sql, whose `CREATE OR REPLACE` definitions can change without a new migration.

Safe to run twice and from concurrent processes: an advisory lock serialises runners, each file applies in
its own transaction, and a changed file that was already applied is an error rather than a silent skip.
Function files are re-applied whenever their text changes (their checksum is recorded too).
"""

from __future__ import annotations

import re
from pathlib import Path

import psycopg

from pipelines.ingest.hashing import hash_text
from pipelines.settings import SQL_DIR

_LOCK_ID = 0x6B62_6D69  # "kbmi"
_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")


def migration_files(sql_dir: Path = SQL_DIR) -> list[tuple[int, Path]]:
    files = []
    for path in sorted(sql_dir.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise ValueError(f"{path}: migration files are named NNN_description.sql")
        files.append((int(match.group(1)), path))
    return files


def migrate(conn: psycopg.Connection, sql_dir: Path = SQL_DIR) -> list[str]:
    """Apply pending migrations; returns the names of those applied now."""
    applied_now = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_ID,))
        conn.execute(
            "CREATE TABLE IF NOT EXISTS kb_schema_migrations ("
            " version int PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = dict(conn.execute("SELECT version, checksum FROM kb_schema_migrations").fetchall())
        for version, path in migration_files(sql_dir):
            text = path.read_text()
            checksum = hash_text(text)
            if version in done:
                if done[version] != checksum:
                    raise RuntimeError(f"{path.name} changed after it was applied; add a new migration instead")
                continue
            with conn.transaction():
                conn.execute(text)
                conn.execute(
                    "INSERT INTO kb_schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                    (version, path.name, checksum),
                )
            applied_now.append(path.name)
        applied_now += _apply_functions(conn, sql_dir / "functions")
    return applied_now


def _apply_functions(conn: psycopg.Connection, functions_dir: Path) -> list[str]:
    conn.execute("CREATE TABLE IF NOT EXISTS kb_schema_functions ("
                 " name text PRIMARY KEY, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")
    done = dict(conn.execute("SELECT name, checksum FROM kb_schema_functions").fetchall())
    applied = []
    for path in sorted(functions_dir.glob("*.sql")):
        text = path.read_text()
        checksum = hash_text(text)
        if done.get(path.name) == checksum:
            continue
        with conn.transaction():
            conn.execute(text)
            conn.execute("INSERT INTO kb_schema_functions (name, checksum) VALUES (%s, %s)"
                         " ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()",
                         (path.name, checksum))
        applied.append(f"functions/{path.name}")
    return applied
