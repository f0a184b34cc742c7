"""Shared fixtures: one real PostgreSQL (embedded, or DATABASE_URL's server) with a fresh database per test,
the real local embedding model loaded once, and Dagster pointed at a temporary home."""

from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from pipelines.settings import SAMPLES_DIR, Settings, load_settings
from pipelines.storage.database import connect, database_url


@pytest.fixture(scope="session")
def server_url(tmp_path_factory) -> str:
    """The server the tests create their databases on: DATABASE_URL if set, else an embedded one."""
    home = tmp_path_factory.mktemp("kb_home")
    os.environ["KB_HOME"] = str(home)
    os.environ["KB_MODEL_CACHE"] = str(home / "models")  # one ONNX export for the whole session
    return database_url(dataclasses.replace(load_settings(), home=home))


def _url_with_db(url: str, dbname: str) -> str:
    info = psycopg.conninfo.conninfo_to_dict(url)
    info["dbname"] = dbname
    return psycopg.conninfo.make_conninfo(**info)


@pytest.fixture
def settings(server_url, tmp_path, monkeypatch) -> Settings:
    """Settings on a brand-new database; also exported to the environment for CLI and Dagster code paths."""
    dbname = f"kb_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    url = _url_with_db(server_url, dbname)
    monkeypatch.setenv("DATABASE_URL", url)
    monkeypatch.setenv("KB_HOME", str(tmp_path / "kb"))
    monkeypatch.delenv("KB_CONFIG", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)  # never touch a developer's Dagster instance
    yield load_settings()
    with psycopg.connect(server_url, autocommit=True) as admin:
        for name in (dbname, f"{dbname}_dagster"):  # and the Dagster instance's, if a test made one
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture
def conn(settings):
    with connect(settings) as connection:
        yield connection


@pytest.fixture(scope="session")
def embedder(server_url):
    from pipelines.models.embedders import make_embedder

    return make_embedder(load_settings())  # the default: int8 ONNX, cached under KB_MODEL_CACHE


@pytest.fixture
def samples_copy(tmp_path) -> Path:
    """A private copy of the sample folder that a test may edit."""
    import shutil

    target = tmp_path / "docs"
    shutil.copytree(SAMPLES_DIR / "docs", target)
    return target


@pytest.fixture
def instance(tmp_path):
    """A throwaway Dagster instance (DAGSTER_HOME points at it while the test runs)."""
    import dagster as dg

    home = tmp_path / "dagster"
    home.mkdir()
    with dg.instance_for_test(temp_dir=str(home)) as test_instance:
        yield test_instance

