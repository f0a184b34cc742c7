"""What a caller may read, decided by the server from today's declarations, for every read: search (both arms,
live and as of a time), answers, citations, cards and `--debug` explanations.

A caller reads the declared sources that are public or share a group with it. As of a past time it also reads
the history of removed sources, with the readers they had (a removed source's row keeps its groups under its retired
name, pipelines/sources/declarations.py), never more. And whatever source a document version belongs to, a
restricted source declared today over its path (source_coverage, sql/015) hides it from callers outside that source's
groups: restricting a folder restricts every version ever kept of what is in it, under every name it was reached by.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

import psycopg
from psycopg import sql

READABLE = """
SELECT source_id, source_key FROM sources
WHERE (removed_at IS NULL OR %(as_of)s::timestamptz IS NOT NULL)
  AND (allowed_groups IS NULL OR allowed_groups && %(groups)s::text[])
  AND (%(source_id)s::text IS NULL OR source_id = %(source_id)s)
ORDER BY source_key
"""
# Parts of sources that a declared, restricted source this caller may not read covers.
HIDDEN = """
SELECT c.source_id, c.prefix FROM source_coverage c JOIN sources r ON r.source_id = c.covered_by
WHERE r.removed_at IS NULL AND r.allowed_groups IS NOT NULL AND NOT r.allowed_groups && %(groups)s::text[]
ORDER BY 1, 2
"""
# A document predicate over `d` (documents) with the parameters of `Readable.params`.
DOCUMENTS = sql.SQL(
    "d.source_id = ANY(%(visible_sources)s) AND NOT EXISTS ("
    " SELECT 1 FROM unnest(%(hidden_sources)s::text[], %(hidden_prefixes)s::text[]) AS h(source_id, prefix)"
    " WHERE d.source_id = h.source_id AND (d.locator = h.prefix OR d.locator ^@ (h.prefix || '/')))")


@dataclass(frozen=True)
class Readable:
    """The sources a caller reads ({source_id: source_key}) and the (source_id, locator prefix) parts of them it
    may not."""

    sources: dict[str, int]
    hidden: tuple[tuple[str, str], ...] = field(default=())

    @property
    def ids(self) -> list[str]:
        return list(self.sources)

    @property
    def keys(self) -> list[int]:
        return list(self.sources.values())

    def params(self) -> dict:
        """The parameters of `DOCUMENTS`."""
        return {"visible_sources": self.ids, "hidden_sources": [s for s, _ in self.hidden],
                "hidden_prefixes": [p for _, p in self.hidden]}


def readable(conn: psycopg.Connection, groups: list[str], source_id: str | None = None,
             as_of: datetime | None = None) -> Readable:
    """What a caller in these groups may read (narrowed to one source when asked), live or as of a time."""
    sources = dict(conn.execute(READABLE, {"groups": list(groups), "source_id": source_id, "as_of": as_of}).fetchall())
    hidden = [(s, prefix) for s, prefix in conn.execute(HIDDEN, {"groups": list(groups)}).fetchall() if s in sources]
    whole = {s for s, prefix in hidden if prefix == ""}
    return Readable({s: key for s, key in sources.items() if s not in whole},
                    tuple((s, prefix) for s, prefix in hidden if s not in whole))
