"""The Dagster instance kb runs on: its storage (runs, events, schedules) in PostgreSQL, in a database of its own on
kb's server (`<kb's database>_dagster`; `kb_dagster` when kb uses the server's `postgres` database, as the embedded
server does), so that any number of machines share one instance
(dagster-postgres), and two knowledge bases on one server never share one."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import psycopg

from pipelines.settings import REPO_ROOT, Settings

STORAGE_ENV = "KB_DAGSTER_STORAGE_URL"


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


def prepare_instance(settings: Settings) -> Path:
    """DAGSTER_HOME (default KB_HOME/dagster) with kb's dagster.yaml, and the storage URL in the environment of
    this process and of what it starts. Returns DAGSTER_HOME."""
    home = Path(os.environ.get("DAGSTER_HOME") or settings.home / "dagster").resolve()
    home.mkdir(parents=True, exist_ok=True)
    config = home / "dagster.yaml"
    if not config.exists() or config.read_text() != (REPO_ROOT / "dagster.yaml").read_text():
        shutil.copy(REPO_ROOT / "dagster.yaml", config)
    os.environ["DAGSTER_HOME"] = str(home)
    os.environ[STORAGE_ENV] = storage_url(settings)
    return home
