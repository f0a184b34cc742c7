"""Runtime settings, read once from the environment so every entry point (CLI, Dagster, tests) agrees."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SQL_DIR = REPO_ROOT / "sql"
SAMPLES_DIR = REPO_ROOT / "samples"
EMBEDDERS = ("local", "local-fp32", "openai")


@dataclass(frozen=True)
class Limits:
    """Bounds on the work one file may cost; a file over a limit is a per-file failure, never the run's."""

    max_file_mb: float = 100.0  # bytes per file (and per JSONL record), checked before reading it
    max_unzipped_mb: float = 256.0  # what a DOCX/PPTX/XLSX expands to, checked before parsing it
    parse_timeout_s: float = 120.0  # a parse worker that takes longer on one file is stopped
    parse_memory_mb: float = 1024.0  # a parse worker whose memory grows past this is stopped
    max_chunks_per_document: int = 20_000
    web_max_pages: int = 10_000  # pages one crawl of a web source fetches at most; past it, it deletes nothing
    web_max_depth: int = 10  # links from the start URL a crawl without a sitemap follows
    web_timeout_s: float = 30.0  # per request to a web source
    web_max_s: float = 3600.0  # one crawl of a web source requests no page after this; past it, it deletes nothing


@dataclass(frozen=True)
class Settings:
    home: Path
    home_origin: str  # how the home was found: "KB_HOME", "found <dir>/.kb", or "per-user default"
    database_url: str | None
    embedder: str  # "local" (int8 ONNX), "local-fp32" (torch) or "openai"
    openai_model: str = "text-embedding-3-small"
    openai_base_url: str | None = None
    openai_api_key: str | None = None
    openai_dimensions: int | None = None
    openai_batch_size: int = 128
    openai_concurrency: int = 4
    openai_max_retries: int = 6
    openai_timeout_s: float = 60.0
    batch_documents: int = 1_000  # documents per publish batch, at most (publish.BATCH_CHUNKS bounds its drafts)
    embed_batch_size: int = 256
    freshness_hours: float = 24.0
    retention_days: int | None = None  # purge closed versions older than this; None keeps all history
    refresh_cron: str = "0 * * * *"
    rerank: str | None = None  # "cross-encoder" | "llm" | None (off)
    rerank_model: str = ""  # a local CrossEncoder path, or the chat model name for "llm"
    chat_model: str | None = None  # an OpenAI-compatible chat model: Q&A cards, answers, HyDE (None: offline rules)
    chat_concurrency: int = 4
    golden_floor: float = 0.8  # a refresh whose golden hit@5 falls below this is not published
    config_path: Path | None = None  # the kb.toml that `kb source apply` reads by default
    parse_workers: int = 1  # processes that parse files in parallel
    unsupported_files: str = "skip"  # a file of a type kb does not read: "skip" (listed) or "fail" (a failed file)
    limits: Limits = Limits()
    model_cache_dir: Path | None = None  # where the exported ONNX model is cached; None means KB_HOME/models

    @property
    def state_dir(self) -> Path:
        self.home.mkdir(parents=True, exist_ok=True)
        return self.home

    @property
    def model_cache(self) -> Path:
        return self.model_cache_dir or self.home / "models"


def _config_path(env) -> Path | None:
    """KB_CONFIG, else a kb.toml in the current directory."""
    if env.get("KB_CONFIG"):
        return Path(env["KB_CONFIG"]).expanduser().resolve()
    local = Path("kb.toml")
    return local.resolve() if local.is_file() else None


class ConfigError(ValueError):
    """A setting that cannot be used as given (a usage error, exit 2)."""


def load_settings(overrides: dict[str, str] | None = None) -> Settings:
    """Settings from the environment; `overrides` (variable name -> value) take precedence, as the Dagster
    resource's fields do, so that every entry point parses and checks settings the same way."""
    try:
        return _load({**os.environ, **(overrides or {})})
    except ConfigError:
        raise
    except ValueError as exc:  # a number that does not parse
        raise ConfigError(f"a KB_* setting is not a valid number: {exc}") from None


def find_home(env, start: Path | None = None) -> tuple[Path, str]:
    """Where the knowledge base lives: KB_HOME; else the nearest `.kb` folder in the current directory or above it
    (the way git finds `.git`), so every command run inside a project uses the project's; else a per-user folder.
    Never a fresh, empty `.kb` just because the command ran from another directory."""
    if env.get("KB_HOME"):
        return Path(env["KB_HOME"]).expanduser().resolve(), "KB_HOME"
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / ".kb").is_dir():
            return folder / ".kb", f"found {folder}/.kb"
    import platformdirs

    return Path(platformdirs.user_data_dir("kb")).resolve(), "per-user default"


def _check_database_url(url: str) -> None:
    """A DATABASE_URL libpq cannot read is a setting to fix (one line), not a driver exception at the first query."""
    import psycopg

    try:
        psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError as exc:
        raise ConfigError(f"DATABASE_URL is not a PostgreSQL connection string ({' '.join(str(exc).split())}): write"
                          " it as postgresql://USER:PASSWORD@HOST:5432/DBNAME, or unset it to use kb's embedded"
                          " server") from None


def _load(env) -> Settings:
    home, origin = find_home(env)
    embedder = env.get("KB_EMBEDDER", "local").lower()
    if embedder not in EMBEDDERS:
        raise ConfigError(f"KB_EMBEDDER must be one of {', '.join(EMBEDDERS)}, not {embedder!r}")
    dims = env.get("KB_OPENAI_DIMENSIONS")
    unsupported = env.get("KB_UNSUPPORTED_FILES", "skip").lower()
    if unsupported not in ("skip", "fail"):
        raise ConfigError(f"KB_UNSUPPORTED_FILES must be skip (list them, fail nothing) or fail, not {unsupported!r}")
    if env.get("DATABASE_URL"):
        _check_database_url(env["DATABASE_URL"])
    return Settings(
        home=home,
        home_origin=origin,
        database_url=env.get("DATABASE_URL") or None,
        embedder=embedder,
        openai_model=env.get("KB_OPENAI_MODEL", "text-embedding-3-small"),
        openai_base_url=env.get("OPENAI_BASE_URL") or None,
        openai_api_key=env.get("OPENAI_API_KEY") or None,
        openai_dimensions=int(dims) if dims else None,
        openai_batch_size=int(env.get("KB_OPENAI_BATCH_SIZE", "128")),
        openai_concurrency=int(env.get("KB_OPENAI_CONCURRENCY", "4")),
        openai_max_retries=int(env.get("KB_OPENAI_MAX_RETRIES", "6")),
        batch_documents=int(env.get("KB_BATCH_DOCUMENTS", "1000")),
        embed_batch_size=int(env.get("KB_EMBED_BATCH_SIZE", "256")),
        freshness_hours=float(env.get("KB_FRESHNESS_HOURS", "24")),
        retention_days=int(env["KB_RETENTION_DAYS"]) if env.get("KB_RETENTION_DAYS") else None,
        refresh_cron=env.get("KB_REFRESH_CRON", "0 * * * *"),
        rerank=env.get("KB_RERANK") or None,
        rerank_model=env.get("KB_RERANK_MODEL", ""),
        chat_model=env.get("KB_CHAT_MODEL") or None,
        chat_concurrency=int(env.get("KB_CHAT_CONCURRENCY", "4")),
        golden_floor=float(env.get("KB_GOLDEN_FLOOR", "0.8")),
        config_path=_config_path(env),
        unsupported_files=unsupported,
        parse_workers=int(env.get("KB_PARSE_WORKERS", str(min(len(os.sched_getaffinity(0)), 4)))),
        limits=Limits(
            max_file_mb=float(env.get("KB_MAX_FILE_MB", Limits.max_file_mb)),
            max_unzipped_mb=float(env.get("KB_MAX_UNZIPPED_MB", Limits.max_unzipped_mb)),
            parse_timeout_s=float(env.get("KB_PARSE_TIMEOUT_S", Limits.parse_timeout_s)),
            parse_memory_mb=float(env.get("KB_PARSE_MEMORY_MB", Limits.parse_memory_mb)),
            max_chunks_per_document=int(env.get("KB_MAX_CHUNKS_PER_DOCUMENT", Limits.max_chunks_per_document)),
            web_max_pages=int(env.get("KB_WEB_MAX_PAGES", Limits.web_max_pages)),
            web_max_depth=int(env.get("KB_WEB_MAX_DEPTH", Limits.web_max_depth)),
            web_timeout_s=float(env.get("KB_WEB_TIMEOUT_S", Limits.web_timeout_s)),
            web_max_s=float(env.get("KB_WEB_MAX_S", Limits.web_max_s)),
        ),
        model_cache_dir=Path(env["KB_MODEL_CACHE"]).expanduser().resolve() if env.get("KB_MODEL_CACHE") else None,
    )
