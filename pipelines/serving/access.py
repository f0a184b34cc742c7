"""Who may read what. A source declares the groups that may read it; an API caller's groups come from its key,
which the server stores (hashed) and binds to groups when an operator creates it. A request may narrow itself
to fewer of its groups, never widen them; a caller with no key reads public sources only.

Keys look like `kb_<key id>_<secret>`. The key id is public (lists, logs); only a SHA-256 of the secret is
stored, which is enough for a random 256-bit secret (a slow password hash protects guessable secrets, and these
are not guessable).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime

import psycopg

from pipelines.sources.declarations import DeclarationError, normalise_groups

PREFIX = "kb"


class AccessDenied(PermissionError):
    pass


@dataclass(frozen=True)
class ApiKey:
    key_id: str
    name: str
    groups: tuple[str, ...]
    created_at: datetime
    created_by: str
    revoked_at: datetime | None = None


COLUMNS = "key_id, name, groups, created_at, created_by, revoked_at"


def _key(row: tuple) -> ApiKey:
    key_id, name, groups, created_at, created_by, revoked_at = row
    return ApiKey(key_id, name, tuple(groups), created_at, created_by, revoked_at)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_key(conn: psycopg.Connection, name: str, groups, who: str) -> tuple[ApiKey, str]:
    """A new key for these groups; returns it and the token, which is shown once and never stored."""
    if not name.strip():
        raise DeclarationError("a key needs a name")
    groups = normalise_groups(groups) or ()
    key_id, secret = secrets.token_hex(6), secrets.token_urlsafe(32)
    try:
        row = conn.execute(f"INSERT INTO api_keys (key_id, name, secret_hash, groups, created_by) VALUES (%s, %s, %s, %s, %s)"
                           f" RETURNING {COLUMNS}", (key_id, name, _digest(secret), list(groups), who)).fetchone()
    except psycopg.errors.UniqueViolation:
        raise DeclarationError(f"a key named {name!r} exists; revoke it first or pick another name") from None
    return _key(row), f"{PREFIX}_{key_id}_{secret}"


def revoke_key(conn: psycopg.Connection, name_or_id: str) -> list[ApiKey]:
    rows = conn.execute(f"UPDATE api_keys SET revoked_at = now() WHERE revoked_at IS NULL AND (name = %s OR key_id = %s)"
                        f" RETURNING {COLUMNS}", (name_or_id, name_or_id)).fetchall()
    return [_key(r) for r in rows]


def list_keys(conn: psycopg.Connection, include_revoked: bool = False) -> list[ApiKey]:
    rows = conn.execute(f"SELECT {COLUMNS} FROM api_keys WHERE %s OR revoked_at IS NULL ORDER BY created_at",
                        (include_revoked,)).fetchall()
    return [_key(r) for r in rows]


def authenticate(conn: psycopg.Connection, token: str) -> ApiKey | None:
    """The live key a token belongs to, or None (unknown, malformed or revoked)."""
    prefix, _, rest = token.partition("_")
    key_id, _, secret = rest.partition("_")
    if prefix != PREFIX or not key_id or not secret:
        return None
    row = conn.execute(f"SELECT secret_hash, {COLUMNS} FROM api_keys WHERE key_id = %s AND revoked_at IS NULL",
                       (key_id,)).fetchone()
    if row is None or not hmac.compare_digest(row[0], _digest(secret)):
        return None
    return _key(row[1:])


def caller_groups(key: ApiKey | None, requested: list[str] | None) -> list[str]:
    """The groups a request reads with: its key's groups, or the subset it asks for. Asking for a group the key
    does not hold is refused, not silently dropped, so a caller learns its mistake."""
    allowed = set(key.groups) if key else set()
    if requested is None:
        return sorted(allowed)
    extra = sorted(set(requested) - allowed)
    if extra:
        who = f"key {key.name!r}" if key else "a request without an API key"
        raise AccessDenied(f"{who} may not read as group(s) {', '.join(extra)}")
    return sorted(set(requested))
