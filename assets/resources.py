"""The one resource kb's assets share: settings, database connections and the embedding model.

Its fields are kb's settings as Dagster sees them: typed, shown in the launchpad and overridable per run. A field
left empty takes kb's own default, read the way the CLI reads it (KB_HOME, DATABASE_URL, KB_EMBEDDER...), so a run
from the UI and `kb ingest` in the same shell agree. Secrets arrive as `dg.EnvVar`s (assets/definitions.py).
Clients are built on first use: loading the definitions imports neither the model nor the parsers.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import cache, cached_property
from typing import Iterator

import dagster as dg
import psycopg
from pydantic import Field

from pipelines.settings import Settings, load_settings

# field -> the environment variable it overrides (README, "Configuration")
SETTINGS = {"home": "KB_HOME", "database_url": "DATABASE_URL", "embedder_kind": "KB_EMBEDDER",
            "openai_base_url": "OPENAI_BASE_URL", "openai_api_key": "OPENAI_API_KEY", "chat_model": "KB_CHAT_MODEL",
            "parse_workers": "KB_PARSE_WORKERS", "parse_timeout_s": "KB_PARSE_TIMEOUT_S",
            "golden_floor": "KB_GOLDEN_FLOOR", "unsupported_files": "KB_UNSUPPORTED_FILES"}
SECRETS = ("database_url", "openai_api_key")


class KnowledgeBase(dg.ConfigurableResource):
    """kb's settings, its PostgreSQL database (the embedded server, started when needed) and its embedding model."""

    home: str | None = Field(default=None, description="KB_HOME: the state folder (default: the nearest .kb folder,"
                                                        " else a per-user one)")
    database_url: str | None = Field(default=None, description="DATABASE_URL (default: kb's embedded server)")
    embedder_kind: str | None = Field(default=None, description="KB_EMBEDDER: local, local-fp32 or openai"
                                                                 " (default local)")
    openai_base_url: str | None = Field(default=None, description="OPENAI_BASE_URL: an OpenAI-compatible endpoint")
    openai_api_key: str | None = Field(default=None, description="OPENAI_API_KEY")
    chat_model: str | None = Field(default=None, description="KB_CHAT_MODEL: Q&A cards and answers (default off)")
    parse_workers: int | None = Field(default=None, description="KB_PARSE_WORKERS (default: the cores, at most 4)")
    parse_timeout_s: float | None = Field(default=None, description="KB_PARSE_TIMEOUT_S (default 120)")
    golden_floor: float | None = Field(default=None, description="KB_GOLDEN_FLOOR: hit@5 a refresh must keep"
                                                                 " (default 0.8)")
    unsupported_files: str | None = Field(default=None, description="KB_UNSUPPORTED_FILES: skip (list files of"
                                                                     " types kb does not read; default) or fail")

    @cached_property
    def settings(self) -> Settings:
        return load_settings({SETTINGS[name]: str(getattr(self, name)) for name in SETTINGS
                              if getattr(self, name) is not None})

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
