"""Per-file failures: a clear reason naming the file, recorded in `failures` and reported by every stage."""

from __future__ import annotations

from dataclasses import dataclass

import psycopg


@dataclass(frozen=True)
class Failure:
    source_id: str
    locator: str
    stage: str
    reason: str

    def __str__(self) -> str:
        return f"{self.source_id}:{self.locator}: {self.reason} ({self.stage})"


def record_failure(conn: psycopg.Connection, failure: Failure, content_hash: str | None) -> None:
    """Upsert the file's current failure; an identical failure leaves the row untouched."""
    conn.execute(
        """
        INSERT INTO failures (source_id, locator, stage, reason, content_hash)
        VALUES (%s, %s, %s, %s, %s)
        ON CONFLICT (source_id, locator) DO UPDATE
            SET stage = excluded.stage, reason = excluded.reason, content_hash = excluded.content_hash,
                recorded_at = now()
            WHERE (failures.stage, failures.reason, failures.content_hash)
                  IS DISTINCT FROM (excluded.stage, excluded.reason, excluded.content_hash)
        """,
        (failure.source_id, failure.locator, failure.stage, failure.reason, content_hash),
    )


def clear_failures(conn: psycopg.Connection, source_id: str, locators: list[str], stage: str) -> None:
    if locators:
        conn.execute(
            "DELETE FROM failures WHERE source_id = %s AND stage = %s AND locator = ANY(%s)",
            (source_id, stage, locators),
        )
