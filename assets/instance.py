"""The Dagster instance kb runs on. kb works on any standard instance, as the deployment configures it: DAGSTER_HOME's
dagster.yaml (Dagster's PostgreSQL storage, or none at all: the default in DAGSTER_HOME), opened through Dagster's
public API only, never rewritten by kb. Without DAGSTER_HOME, kb's commands use KB_HOME/dagster with the
repository's dagster.yaml, a convenience for the embedded default described below.

That default keeps its storage (runs, events, schedules, sensor cursors, partitions) in PostgreSQL,
in a database of its own on kb's server (`<kb's database>_dagster`; `kb_dagster` when kb uses the server's
`postgres` database, as the embedded server does), so that any number of machines share one instance
(dagster-postgres) and two knowledge bases on one server never share one.

The repository's dagster.yaml names `KbStorage`, which finds that database the way kb finds its own: DATABASE_URL,
else kb's embedded server under KB_HOME, started when needed. So the plain Dagster commands run from the
repository root with no environment variable set (`dagster dev -w workspace.yaml`, `dagster asset materialize -m
assets.definitions ...`; Dagster reads ./dagster.yaml when DAGSTER_HOME is unset) share one instance with `kb`,
and each process that opens the instance keeps the embedded server up for as long as it runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import click
import dagster as dg
import psycopg
from dagster_postgres import DagsterPostgresStorage

from pipelines.settings import REPO_ROOT, Settings, load_settings
from pipelines.storage.state import write_atomic


def storage_url(settings: Settings) -> str:
    """A SQLAlchemy URL (psycopg2, which dagster-postgres speaks) for the instance database on kb's server."""
    from urllib.parse import quote

    from pipelines.storage.database import database_url, ensure_database

    kb_url = database_url(settings)
    kb_database = psycopg.conninfo.conninfo_to_dict(kb_url).get("dbname") or "postgres"
    kb_database = "kb" if kb_database == "postgres" else kb_database
    info = psycopg.conninfo.conninfo_to_dict(ensure_database(kb_url, f"{kb_database[:55]}_dagster"))
    user = quote(info.get("user") or "postgres")
    password = f":{quote(info['password'])}" if info.get("password") else ""
    host = info.get("host") or "localhost"
    if host.startswith("/"):  # a unix socket folder (the embedded server)
        return f"postgresql+psycopg2://{user}{password}@/{info['dbname']}?host={quote(host)}&port={info.get('port') or 5432}"
    return f"postgresql+psycopg2://{user}{password}@{host}:{info.get('port') or 5432}/{info['dbname']}"


class KbStorage(DagsterPostgresStorage):
    """dagster-postgres storage in kb's PostgreSQL (`storage: custom: {module: assets.instance, class: KbStorage}`).
    `postgres_url` overrides where, for an instance kept on another server."""

    @classmethod
    def config_type(cls):
        return {"postgres_url": dg.Field(dg.StringSource, is_required=False,
                                         description="default: a database beside kb's, on kb's server")}

    @classmethod
    def from_config_value(cls, inst_data, config_value) -> "KbStorage":
        return cls(postgres_url=config_value.get("postgres_url") or _kb_storage_url(), inst_data=inst_data)


class InstanceUnavailable(click.ClickException):
    """The instance cannot open because kb's PostgreSQL cannot serve it. Every program that opens the instance is a
    click command (`dagster asset materialize`, `dagster dev`, the daemon, `kb`), and click prints a ClickException
    as its one line, `Error: ...`, and exits 2, where any other exception here is a traceback of Dagster's internals
    before any run exists."""

    exit_code = 2


def _kb_storage_url() -> str:
    """storage_url for kb's own settings; a server that cannot serve the instance is InstanceUnavailable's line."""
    from pipelines.storage.database import DatabaseUnavailable, location

    settings = load_settings()
    try:
        return storage_url(settings)
    except DatabaseUnavailable as exc:  # the embedded server did not start: its line says why
        raise InstanceUnavailable(f"Dagster's instance cannot open: {exc}") from None
    except psycopg.OperationalError as exc:
        raise InstanceUnavailable(
            f"Dagster's instance cannot open: its storage is on kb's PostgreSQL at {location(settings)}, which does"
            f" not answer ({' '.join(str(exc).split())}); check DATABASE_URL, or unset it to use kb's embedded"
            " server") from None


def dagster_home(settings: Settings) -> Path:
    """DAGSTER_HOME, used as it is; else KB_HOME/dagster, holding kb's dagster.yaml, kept current (a copy cut short
    or damaged is simply replaced)."""
    if os.environ.get("DAGSTER_HOME"):
        return Path(os.environ["DAGSTER_HOME"]).resolve()
    home = (settings.home / "dagster").resolve()
    home.mkdir(parents=True, exist_ok=True)
    config, ours = home / "dagster.yaml", (REPO_ROOT / "dagster.yaml").read_bytes()
    if not config.exists() or config.read_bytes() != ours:
        write_atomic(config, ours)
    return home


def open_instance(settings: Settings) -> dg.DagsterInstance:
    """The instance `kb` commands use: the same one as the Dagster UI, daemon and workers, opened by Dagster's own
    DagsterInstance.get() on the home above (which is DAGSTER_HOME only while it opens: the process's environment is
    left as it was)."""
    home, before = dagster_home(settings), os.environ.get("DAGSTER_HOME")
    os.environ["DAGSTER_HOME"] = str(home)
    try:
        return dg.DagsterInstance.get()
    finally:
        if before is None:
            del os.environ["DAGSTER_HOME"]
