"""Per-source advisory locks: two runs of one source never interleave; runs of different sources do not wait."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import psycopg

LOCK_NAMESPACE = 0x6B62  # "kb": the first key of the two-key advisory lock (a source's run holds hashtext(source_id))


@contextmanager
def source_locks(conn: psycopg.Connection, source_ids: list[str], shared: bool = False) -> Iterator[None]:
    """Hold a session-level lock per source (taken in sorted order, so two runs can never deadlock). `shared`: the
    run only adds vectors (a model backfill's shard), so its shards run side by side while no refresh runs."""
    lock, unlock = ("pg_advisory_lock_shared", "pg_advisory_unlock_shared") if shared else \
        ("pg_advisory_lock", "pg_advisory_unlock")
    held = []
    try:
        for source_id in sorted(set(source_ids)):
            conn.execute(f"SELECT {lock}(%s, hashtext(%s))", (LOCK_NAMESPACE, source_id))
            held.append(source_id)
        yield
    finally:
        if not (conn.closed or conn.broken):  # a lost connection took its session locks with it; do not hide why
            for source_id in reversed(held):
                conn.execute(f"SELECT {unlock}(%s, hashtext(%s))", (LOCK_NAMESPACE, source_id))
