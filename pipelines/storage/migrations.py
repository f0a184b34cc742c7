"""kb's schema: sql/NNN_*.sql applied in order, once each, and sql/functions/*.sql, whose `CREATE OR REPLACE`
definitions can change without a new migration, re-applied whenever their text changes. Both are recorded with
their checksums (kb_schema_migrations, kb_schema_functions), so a process can tell cheaply what is pending.

Applying is an explicit step (`kb migrate`, the Dagster `migrate` job; a brand-new database is installed by the
CLI, Dagster and the tests on first use): a migration may rebuild HNSW indexes for minutes (about 11 at 1M chunks),
so it never runs because some process happened to connect first (pipelines/storage/database.py checks instead).

Safe to run twice and from concurrent processes: an advisory lock serialises runners (a second one waits, then
finds nothing pending), each migration applies in its own transaction (an interrupted run keeps the files it
finished) but the last, which commits with the function files, and a changed file that was already applied is an
error rather than a silent skip.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from psycopg import sql

from pipelines.ingest.hashing import hash_text
from pipelines.settings import SQL_DIR

_LOCK_ID = 0x6B62_6D69  # "kbmi": one bigint key, so pg_locks shows it as classid 0, objid _LOCK_ID
_NAME = re.compile(r"^(\d{3})_[a-z0-9_]+\.sql$")
DEFAULT_WAIT_S = 60.0

# How fast a migration's heavy work goes on the embedded server of a small machine (bench/README.md): a table
# rewritten with its indexes (sql/013 rewrote the 1.15 GB of 100k chunks' tables in about 28 s), and an HNSW index
# built (1M 384-d vectors in 650 s, 100k in 56 s).
REWRITE_BYTES_PER_S = 40e6
HNSW_VECTORS_PER_S = 1_500
RATES = "rewrites at about 40 MB/s, HNSW builds at about 1,500 vectors/s, as measured in bench/README.md"

# A migration may say what it costs in a header line, e.g. `-- kb-migrate: rewrites chunks, lexical_postings;
# rebuilds hnsw`; without one, the tables its statements name and any mention of hnsw are taken as its cost.
_DECLARED = re.compile(r"^--\s*kb-migrate:(.*)$", re.MULTILINE)
_TOUCHED = re.compile(r"\b(?:ALTER\s+TABLE(?:\s+IF\s+EXISTS)?|UPDATE|INSERT\s+INTO|DELETE\s+FROM|CLUSTER|"
                      r"CREATE\s+(?:UNIQUE\s+)?INDEX\s+(?:IF\s+NOT\s+EXISTS\s+)?\w*\s*ON)\s+(?:ONLY\s+)?(\w+)",
                      re.IGNORECASE)


@dataclass(frozen=True)
class SchemaFile:
    """A migration (version set) or a function file (version None), as this checkout has it."""

    name: str  # "014_compact_postings.sql" or "functions/lexical.sql": what kb prints and records
    text: str
    version: int | None

    @property
    def checksum(self) -> str:
        return hash_text(self.text)


class MigrationLockBusy(RuntimeError):
    """Another process held the migration lock for longer than this one would wait."""


def migration_files(sql_dir: Path = SQL_DIR) -> list[tuple[int, Path]]:
    files = []
    for path in sorted(sql_dir.glob("*.sql")):
        match = _NAME.match(path.name)
        if not match:
            raise ValueError(f"{path}: migration files are named NNN_description.sql")
        files.append((int(match.group(1)), path))
    return files


def schema_files(sql_dir: Path = SQL_DIR) -> list[SchemaFile]:
    """Every file of the schema in the order it applies: migrations, then functions."""
    return ([SchemaFile(path.name, path.read_text(), version) for version, path in migration_files(sql_dir)]
            + [SchemaFile(f"functions/{path.name}", path.read_text(), None)
               for path in sorted((sql_dir / "functions").glob("*.sql"))])


def is_installed(conn: psycopg.Connection) -> bool:
    """Whether this database holds any of kb's schema (a brand-new one holds none)."""
    return (_exists(conn, "kb_schema_migrations")
            and conn.execute("SELECT EXISTS (SELECT FROM kb_schema_migrations)").fetchone()[0])


def pending(conn: psycopg.Connection, sql_dir: Path = SQL_DIR) -> list[SchemaFile]:
    """The files this database still needs, in the order they apply. Two small reads: cheap enough for every
    process's first connection. An applied migration whose file has changed since is an error."""
    migrations = dict(conn.execute("SELECT version, checksum FROM kb_schema_migrations").fetchall()) \
        if _exists(conn, "kb_schema_migrations") else {}
    functions = dict(conn.execute("SELECT 'functions/' || name, checksum FROM kb_schema_functions").fetchall()) \
        if _exists(conn, "kb_schema_functions") else {}
    todo = []
    for item in schema_files(sql_dir):
        if item.version is None:
            if functions.get(item.name) != item.checksum:
                todo.append(item)
        elif item.version not in migrations:
            todo.append(item)
        elif migrations[item.version] != item.checksum:
            raise RuntimeError(f"{item.name} changed after it was applied; add a new migration instead")
    return todo


def migrate(conn: psycopg.Connection, sql_dir: Path = SQL_DIR, *, wait_s: float = DEFAULT_WAIT_S,
            before: Callable[[list[SchemaFile]], None] | None = None,
            applied: Callable[[SchemaFile, float], None] | None = None) -> list[str]:
    """Apply what is pending under the migration lock, each file in its own transaction except the last migration,
    which commits with the function files (`_transactions`); returns the names applied. `before(files)` hears what
    will be applied once the lock is held (nothing when none is pending), `applied(file, seconds)` each file once it
    is committed. A file that fails raises with `failed_file` set to its name."""
    names = []
    with migration_lock(conn, wait_s):
        _create_ledgers(conn)
        todo = pending(conn, sql_dir)
        if todo and before:
            before(todo)
        for group in _transactions(todo):
            seconds = []
            with conn.transaction():
                for item in group:
                    started = time.perf_counter()
                    try:
                        _apply(conn, item)
                    except psycopg.Error as exc:
                        exc.failed_file = item.name  # type: ignore[attr-defined]
                        raise
                    seconds.append(time.perf_counter() - started)
            for item, spent in zip(group, seconds):
                names.append(item.name)
                if applied:
                    applied(item, spent)
    return names


def _transactions(todo: list[SchemaFile]) -> list[list[SchemaFile]]:
    """Each migration alone, so that an interrupted run keeps those it finished, except the last, which commits with
    the function files: a migration may change what the functions read (sql/021 drops a column the old trigger
    functions read), and no transaction may then see the new tables with the old functions."""
    migrations = [item for item in todo if item.version is not None]
    functions = [item for item in todo if item.version is None]
    groups = [[item] for item in migrations[:-1]] + [migrations[-1:] + functions]
    return [group for group in groups if group]


@contextmanager
def migration_lock(conn: psycopg.Connection, wait_s: float) -> Iterator[None]:
    """The migration lock for this session, waiting at most wait_s for it; MigrationLockBusy names the holder.
    The key is the one every kb version takes, so an older kb that migrates inside connect() is excluded too."""
    conn.execute("SELECT set_config('lock_timeout', %s, false)", (f"{max(1, round(wait_s * 1000))}ms",))
    try:
        conn.execute("SELECT pg_advisory_lock(%s)", (_LOCK_ID,))
    except psycopg.errors.LockNotAvailable:
        raise MigrationLockBusy(f"kb's migration lock is held by {_lock_holder(conn)}, and was not released within"
                                f" {wait_s:g} s: a migration is running (it can take minutes; its own output says"
                                " how long). Run the command again once it is done") from None
    finally:
        conn.execute("RESET lock_timeout")
    try:
        yield
    finally:
        if not (conn.closed or conn.broken):
            conn.execute("SELECT pg_advisory_unlock(%s)", (_LOCK_ID,))


def _lock_holder(conn: psycopg.Connection) -> str:
    row = conn.execute(
        "SELECT a.pid, a.application_name, coalesce(host(a.client_addr), 'a local socket'),"
        " to_char(a.backend_start, 'YYYY-MM-DD HH24:MI:SS TZ'), a.state, left(a.query, 120)"
        " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
        " WHERE l.locktype = 'advisory' AND l.granted AND l.classid = 0 AND l.objid::bigint = %s AND l.objsubid = 1"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",  # locks are per database
        (_LOCK_ID,)).fetchone()
    if row is None:
        return "another session (gone by now)"
    pid, application, client, since, state, query = row
    return (f"PostgreSQL backend {pid} ({'application ' + repr(application) if application else 'no application name'},"
            f" connected from {client} since {since}; {state}: {' '.join((query or '').split())!r})")


def _create_ledgers(conn: psycopg.Connection) -> None:
    conn.execute("CREATE TABLE IF NOT EXISTS kb_schema_migrations ("
                 " version int PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
                 " applied_at timestamptz NOT NULL DEFAULT now())")
    conn.execute("CREATE TABLE IF NOT EXISTS kb_schema_functions ("
                 " name text PRIMARY KEY, checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())")


def _apply(conn: psycopg.Connection, item: SchemaFile) -> None:
    """One file and its ledger row, inside the caller's transaction."""
    conn.execute(item.text)
    if item.version is None:
        conn.execute("INSERT INTO kb_schema_functions (name, checksum) VALUES (%s, %s)"
                     " ON CONFLICT (name) DO UPDATE SET checksum = excluded.checksum, applied_at = now()",
                     (item.name.removeprefix("functions/"), item.checksum))
    else:
        conn.execute("INSERT INTO kb_schema_migrations (version, name, checksum) VALUES (%s, %s, %s)",
                     (item.version, item.name, item.checksum))


def _exists(conn: psycopg.Connection, table: str) -> bool:
    return conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()[0]


@dataclass(frozen=True)
class Cost:
    """What applying a file will rewrite and rebuild in this database, and about how long that takes."""

    rewrites: dict[str, int]  # table -> its bytes with indexes
    hnsw_vectors: int  # vectors whose HNSW index is rebuilt

    @property
    def seconds(self) -> float:
        return sum(self.rewrites.values()) / REWRITE_BYTES_PER_S + self.hnsw_vectors / HNSW_VECTORS_PER_S

    def describe(self) -> str:
        parts = []
        if self.rewrites:
            parts.append(f"rewrites {', '.join(self.rewrites)} ({_size(sum(self.rewrites.values()))})")
        if self.hnsw_vectors:
            parts.append(f"rebuilds HNSW over {self.hnsw_vectors:,} vectors")
        return "; ".join(parts) or "nothing large"

    def as_dict(self) -> dict:
        return {"work": self.describe(), "estimate_s": round(self.seconds, 1), "rewrites_bytes": self.rewrites,
                "hnsw_vectors": self.hnsw_vectors}


def estimate(conn: psycopg.Connection, item: SchemaFile) -> Cost:
    """The cost of one pending file, from the sizes of the tables it touches (its `-- kb-migrate:` header, else the
    tables its statements name) and the vectors of every model when it rebuilds HNSW. Function files only
    (re)define functions. A rough figure, to decide when to run it, not a promise."""
    if item.version is None:
        return Cost({}, 0)
    declared = _DECLARED.search(item.text)
    if declared:
        parts = dict(part.strip().partition(" ")[::2] for part in declared.group(1).split(";"))
        tables = [t.strip() for t in parts.get("rewrites", "").split(",") if t.strip()]
        hnsw = "hnsw" in parts.get("rebuilds", "").lower()
    else:
        statements = re.sub(r"--[^\n]*", "", item.text)
        tables = list(dict.fromkeys(name.lower() for name in _TOUCHED.findall(statements)))
        hnsw = "hnsw" in statements.lower()
    sizes = {table: conn.execute("SELECT pg_total_relation_size(to_regclass(%s))", (table,)).fetchone()[0]
             for table in tables}
    return Cost({table: size for table, size in sizes.items() if size}, _vectors(conn) if hnsw else 0)


def _vectors(conn: psycopg.Connection) -> int:
    """Rows of every model's vector table: the planner's statistics (counting 1M rows takes seconds), or a count
    for a table never analyzed."""
    if not _exists(conn, "embedding_models"):
        return 0
    total = 0
    for table, rows in conn.execute("SELECT m.vector_table, c.reltuples FROM embedding_models m"
                                    " JOIN pg_class c ON c.oid = to_regclass(quote_ident(m.vector_table))"):
        total += int(rows) if rows >= 0 else conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0]
    return total


def _size(size: int) -> str:
    if size < 1024 ** 2:
        return f"{size / 1024:.0f} KB"
    return f"{size / 1024 ** 2:.0f} MB" if size < 1024 ** 3 else f"{size / 1024 ** 3:.1f} GB"


def duration(seconds: float) -> str:
    """An estimate in words a person plans with: under a second, about 40 s, about 11 min, about 2.5 h."""
    if seconds < 1:
        return "under a second"
    if seconds < 90:
        return f"about {seconds:.0f} s"
    if seconds < 90 * 60:
        return f"about {seconds / 60:.0f} min"
    return f"about {seconds / 3600:.1f} h"
