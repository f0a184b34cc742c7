"""The chat model kb talks to (KB_CHAT_MODEL on OPENAI_BASE_URL): for Q&A cards, answers, HyDE and the LLM
reranker. Any OpenAI-compatible endpoint; the openai client retries 408/409/429/5xx and timeouts with
exponential backoff and honours Retry-After, as for embeddings."""

from __future__ import annotations

import hashlib
import os
import socket
from urllib.parse import urlsplit

from pipelines.settings import ConfigError, Settings

OPENAI_ENDPOINT = "https://api.openai.com/v1"
PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_reached: set[str] = set()  # endpoints this process has connected to (a later outage is the client's to retry)


class ChatNotConfigured(RuntimeError):
    pass


def endpoint(settings: Settings) -> str:
    return settings.openai_base_url or OPENAI_ENDPOINT


def client_identity(settings: Settings) -> tuple:
    """What tells two OpenAI clients apart (endpoint, key, retries, timeout): a client or embedder cached in a
    process is reused only under the same identity, so a moved endpoint, a rotated key or a second configuration
    is never answered by the old one. The key enters as a digest, so the cache's keys never hold it."""
    key = hashlib.sha256(settings.openai_api_key.encode()).hexdigest() if settings.openai_api_key else None
    return endpoint(settings), key, settings.openai_max_retries, settings.openai_timeout_s


def _user(settings: Settings) -> str:
    return f"KB_CHAT_MODEL={settings.chat_model}" if settings.chat_model else "KB_EMBEDDER=openai"


def check_endpoint(settings: Settings, needed_by: str | None = None) -> None:
    """Fail at once, naming the setting and the endpoint, when the endpoint cannot serve: no key for api.openai.com
    and no other server, or nothing listening where OPENAI_BASE_URL points. Without this the client's retries
    spend about 24 s before a bare `Connection error.`. (Behind a proxy only the client can tell.)"""
    needed_by = needed_by or _user(settings)
    if not settings.openai_api_key and not settings.openai_base_url:
        raise ConfigError(f"{needed_by} needs an OpenAI-compatible endpoint and none is configured: set OPENAI_API_KEY"
                          f" to use {OPENAI_ENDPOINT}, or OPENAI_BASE_URL to use another server (a local one may need"
                          " no key)")
    url = endpoint(settings)
    if url in _reached or any(os.environ.get(name) for name in PROXIES):
        return
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"OPENAI_BASE_URL {url!r} is not an http(s) URL, such as http://localhost:8080/v1")
    try:
        socket.create_connection((parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)),
                                 timeout=5).close()
    except OSError as exc:
        where = "OPENAI_BASE_URL" if settings.openai_base_url else "the network (no OPENAI_BASE_URL is set)"
        raise ConfigError(f"{needed_by}: cannot reach {url} ({exc.strerror or exc}); check {where} and that the"
                          " server is running") from None
    _reached.add(url)


def openai_client(settings: Settings, needed_by: str | None = None):
    """The client for OPENAI_BASE_URL, chat and embeddings alike (its key, retries and timeout), once the endpoint is
    known to be configured and listening (`needed_by` names the setting that wants it, for the error)."""
    from openai import OpenAI

    check_endpoint(settings, needed_by)
    return OpenAI(api_key=settings.openai_api_key or "not-needed", base_url=settings.openai_base_url,
                  max_retries=settings.openai_max_retries, timeout=settings.openai_timeout_s)


def complete(client, model: str, prompt: str) -> str:
    """One user message, temperature 0; the reply's text ("" when the model returns none)."""
    reply = client.chat.completions.create(model=model, temperature=0, messages=[{"role": "user", "content": prompt}])
    return reply.choices[0].message.content or ""
