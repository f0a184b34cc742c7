"""The one resource kb's assets share: settings, database connections and the embedding model.

It has no fields on purpose. What a deployment is (its database, models, endpoints, keys, sources) comes from the
deployment: the environment the code location runs in (KB_HOME, DATABASE_URL, KB_EMBEDDER, OPENAI_*...), kb.toml
and the database, read the way the CLI reads them, so a run from the UI and `kb ingest` in the same shell agree. A
run config can choose where its steps execute (`execution`) and its confirmations (the ingest op's config), never
where data goes: a launchpad override of this resource is refused by Dagster's config check before the run starts
("Received unexpected config entry"), so no run can send a restricted source's chunks or the deployment's key to
another endpoint, or write into another database. Clients are built on first use: loading the definitions imports
neither the model nor the parsers.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache, cached_property
from typing import Iterator

import dagster as dg
import psycopg

from pipelines.settings import Settings, load_settings


class KnowledgeBase(dg.ConfigurableResource):
    """kb's settings from the deployment, its PostgreSQL database (the embedded server, started when needed) and its
    embedding model."""

    @cached_property
    def settings(self) -> Settings:
        return load_settings()

    @contextmanager
    def connect(self) -> Iterator[psycopg.Connection]:
        """kb's database. One that cannot serve kb (DATABASE_URL wrong, the server down, no pgvector, the schema
        behind) fails the step with kb's one line as the run's failure. Only a server that did not answer is retried
        (the step's retry policy: it may be restarting); the rest would fail the same way again."""
        from pipelines.storage.database import DatabaseUnavailable, connect

        try:
            with connect(self.settings) as conn:
                yield conn
        except DatabaseUnavailable as exc:
            raise dg.Failure(description=str(exc), allow_retries=exc.may_pass) from None

    @property
    def embedder(self):
        """One model per process and configuration: the steps a worker process runs one after another (a
        backfill's shards on a dask worker) load it once, not once per step."""
        return _embedder(self.settings)


@cache
def _embedder(settings: Settings):
    from pipelines.models.embedders import make_embedder

    return make_embedder(settings)
