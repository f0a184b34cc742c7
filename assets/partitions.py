"""Partitions: one per declared source for ingestion (a backfill's 16 hash shards are ops: assets/maintenance.py).

Source partitions are dynamic (`kb_sources`, named in the namespace: assets/namespace.py): the `sources` table is
the truth (kb.toml or `kb source ...`), and `sync_source_partitions` (run by the `kb_source_partitions` sensor and
by the CLI when it changes a declaration) keeps the instance in step, so a source declared from the CLI appears in
the UI without a restart.
Per-document state lives in PostgreSQL, never in partitions, which keeps Dagster's UI fast at a million documents.
"""

import dagster as dg

from assets.namespace import DEFAULT

sources = DEFAULT.sources
SOURCES = sources.name


def partition_changes(existing: list[str], declared: list[str]) -> tuple[list[str], list[str]]:
    """(partitions to add, partitions to delete) so that the instance holds exactly the declared sources."""
    return sorted(set(declared) - set(existing)), sorted(set(existing) - set(declared))


def sync_source_partitions(instance: dg.DagsterInstance, declared: list[str]) -> tuple[list[str], list[str]]:
    added, deleted = partition_changes(instance.get_dynamic_partitions(SOURCES), declared)
    if added:
        instance.add_dynamic_partitions(SOURCES, added)
    for key in deleted:
        instance.delete_dynamic_partition(SOURCES, key)
    return added, deleted
