"""The one resource kb's assets share: settings, database connections and the embedding model."""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache, cached_property
from typing import Iterator

import dagster as dg
import psycopg

from pipelines.settings import Settings, load_settings


class KnowledgeBase(dg.ConfigurableResource):
    """Reads KB_HOME, DATABASE_URL, KB_EMBEDDER... like the CLI (sources are declared in the database); clients
    are built on first use."""

    @cached_property
    def settings(self) -> Settings:
        return load_settings()

    @contextmanager
    def connect(self) -> Iterator[psycopg.Connection]:
        from pipelines.storage.database import connect

        with connect(self.settings) as conn:
            yield conn

    @property
    def embedder(self):
        """One model per process and configuration: the steps a worker process runs one after another (a
        backfill's shards on a dask worker) load it once, not once per step."""
        return _embedder(self.settings)


@cache
def _embedder(settings: Settings):
    from pipelines.models.embedders import make_embedder

    return make_embedder(settings)
