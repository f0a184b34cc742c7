"""Partitions: one per configured source for ingestion, 16 hash shards for embedding backfills.

Per-document state lives in PostgreSQL, never in partitions: a million documents are still 16 shards, which keeps
Dagster's UI fast and lets a backfill fan out over any executor or run launcher.
"""

import dagster as dg

from pipelines.settings import load_settings

sources = dg.StaticPartitionsDefinition(sorted(load_settings().sources))
hash_shards = dg.StaticPartitionsDefinition(list("0123456789abcdef"))
