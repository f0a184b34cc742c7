"""Vector writes: the bulk writer is idempotent and atomic per batch; big loads build the HNSW index once, after."""

import dataclasses

import numpy as np
import psycopg
import pytest
from psycopg import sql

from pipelines.ingest.embed import embed_pending, store_vectors
from pipelines.ingest.run import ingest
from pipelines.settings import SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare
from pipelines.storage import vectors as vector_store
from pipelines.storage.vectors import ensure_vector_store


def rows(conn, table: str) -> list:
    """(xmin, hash, vector) per row: a rewritten row shows even when its values are equal."""
    return conn.execute(sql.SQL("SELECT xmin::text, text_hash, embedding::text FROM {} ORDER BY 2")
                        .format(sql.Identifier(table))).fetchall()


def hnsw_index(conn, table: str) -> str | None:
    row = conn.execute("SELECT indexdef FROM pg_indexes WHERE tablename = %s AND indexdef LIKE '%%USING hnsw%%'",
                       (table,)).fetchone()
    return row[0] if row else None


def test_bulk_writer_is_idempotent_and_atomic_per_batch(conn):
    table = ensure_vector_store(conn, "test:bulk:4", 4)
    target = sql.Identifier(table)
    vectors = np.eye(3, 4, dtype=np.float32)
    assert store_vectors(conn, target, ["a", "b", "c"], vectors) == 3
    stored = rows(conn, table)
    assert store_vectors(conn, target, ["a", "b", "c"], vectors) == 0
    assert rows(conn, table) == stored, "a rerun rewrites nothing"

    bad = np.array([[0, 0, 0, 1], [np.nan, 0, 0, 0]], dtype=np.float32)
    with pytest.raises(psycopg.Error, match="NaN"):
        store_vectors(conn, target, ["d", "e"], bad)
    assert rows(conn, table) == stored, "a failed batch leaves nothing half-written and loses nothing stored"
    assert store_vectors(conn, target, ["c", "d"], np.eye(2, 4, dtype=np.float32)) == 1


def test_a_new_model_stores_half_precision_vectors(conn):
    """A 384-d vector costs 776 bytes (2 a dimension, halfvec), not 1,544, in its table and in its HNSW index."""
    table = ensure_vector_store(conn, "test:half:384", 384)
    vector = np.full((1, 384), 384 ** -0.5, dtype=np.float32)
    assert store_vectors(conn, sql.Identifier(table), ["a"], vector) == 1
    size = conn.execute(sql.SQL("SELECT pg_column_size(embedding) FROM {}").format(sql.Identifier(table))).fetchone()
    assert size[0] == 8 + 2 * 384
    assert "halfvec_cosine_ops" in hnsw_index(conn, table)


def test_big_load_builds_the_index_after_the_rows_small_ones_use_it(conn, embedder, monkeypatch):
    monkeypatch.setattr(vector_store, "DEFER_INDEX_MIN_ROWS", 10)  # the sample corpus has ~40 chunks
    add_source(conn, declare("samples", SAMPLES_DIR / "docs"), "tests")
    summary = ingest(conn, embedder, load_settings())
    table = vector_store.table_name(embedder.model_key)
    assert summary.stage("embed").counts["index_deferred"] == 1
    assert hnsw_index(conn, table) is not None, "the index is rebuilt at the end of the load"
    total = summary.stage("embed").counts["computed"] + summary.stage("cards").counts["cards"]  # Q&A cards too

    # A small change goes through the live index: nothing is dropped under a serving table.
    conn.execute(sql.SQL("DELETE FROM {} WHERE text_hash IN (SELECT text_hash FROM {} LIMIT 3)")
                 .format(sql.Identifier(table), sql.Identifier(table)))
    report = embed_pending(conn, embedder)
    assert report.counts["computed"] == 3 and report.counts["index_deferred"] == 0
    assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0] == total

    # A load interrupted after dropping the index (a crash) gets it back on the next run, even with nothing to do.
    conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(f"{table}_hnsw")))
    assert embed_pending(conn, embedder).counts["computed"] == 0
    assert hnsw_index(conn, table) is not None


def test_shards_starting_together_register_a_new_model_once(conn, settings):
    """Backfill shards on several workers all call ensure_vector_store for a model nobody registered yet."""
    from concurrent.futures import ThreadPoolExecutor
    from threading import Barrier

    from pipelines.storage.database import connect

    start = Barrier(8, timeout=60)

    def shard(_: int) -> str:
        with connect(settings) as own:
            start.wait()
            return ensure_vector_store(own, "test:race:4", 4)

    with ThreadPoolExecutor(8) as pool:
        tables = list(pool.map(shard, range(8)))
    assert len(set(tables)) == 1
    assert conn.execute("SELECT count(*) FROM embedding_models WHERE model_key = 'test:race:4'").fetchone()[0] == 1


def test_long_model_keys_never_share_a_vector_table():
    one = vector_store.table_name("openai:my-org/a-very-long-embedding-model-name-that-goes-on-v1:3072")
    two = vector_store.table_name("openai:my-org/a-very-long-embedding-model-name-that-goes-on-v2:3072")
    assert one != two and len(one) <= 58 and len(two) <= 58  # room for the index's _hnsw suffix
    assert vector_store.table_name("openai:fake-embed:8") == "vectors_openai_fake_embed_8"  # short keys stay readable


def test_a_registered_model_whose_table_is_gone_gets_an_empty_one_and_the_purge_skips_it(conn):
    """Before issue 18 kb dropped a retired model's table and kept its row: configured again, every ingest exited
    1 (relation does not exist). Its table is now created again, empty; it stays retired until an operator
    switches; the retention purge, which now also cleans retired tables, skips tables that are missing."""
    from pipelines.storage.history import purge_history

    serving = ensure_vector_store(conn, "test:serving:4", 4)
    conn.execute("INSERT INTO embedding_models (model_key, dimensions, vector_table, state)"
                 " VALUES ('test:dropped:4', 4, 'vectors_test_dropped_4', 'retired')")
    assert purge_history(conn, 30) == {"chunks_purged": 0, "vectors_purged": 0}
    assert ensure_vector_store(conn, "test:dropped:4", 4) == "vectors_test_dropped_4"
    assert rows(conn, "vectors_test_dropped_4") == []
    states = dict(conn.execute("SELECT model_key, state FROM embedding_models").fetchall())
    assert states == {"test:serving:4": "active", "test:dropped:4": "retired"} and vector_store.active_model(conn) == "test:serving:4"
    assert hnsw_index(conn, serving) and not hnsw_index(conn, "vectors_test_dropped_4")


def test_each_shard_counts_the_vectors_it_reuses_in_its_own_shard_only(conn, embedder):
    """A dask refresh embeds 16 shards; each shard's report counts the drafts of its shard whose vector is stored,
    so that in all each draft is counted once (each shard used to probe the vectors for every draft)."""
    from pipelines.ingest.chunk import chunk_pending
    from pipelines.ingest.embed import SHARDS
    from pipelines.ingest.enrich import enrich_pending
    from pipelines.ingest.extract import extract
    from pipelines.ingest.parse import parse_pending
    from pipelines.sources.declarations import load_sources

    add_source(conn, declare("samples", SAMPLES_DIR / "docs"), "tests")
    extract(conn, load_sources(conn))
    parse_pending(conn)
    chunk_pending(conn, embedder.counter)
    enrich_pending(conn, embedder.counter)
    drafts = conn.execute("SELECT count(*) FROM chunk_drafts WHERE text_hash IS NOT NULL").fetchone()[0]
    assert embed_pending(conn, embedder).counts["computed"] > 0  # drafts stay until publish
    reused = [embed_pending(conn, embedder, shards=[shard]).counts["reused"] for shard in SHARDS]
    assert sum(reused) == drafts and max(reused) < drafts


def _distinct_folder(path, documents: int):
    path.mkdir()
    for n in range(documents):
        (path / f"note-{n:03d}.md").write_text(f"# Note {n}\n\nEntry {n}: the widget batch W-{n:04d} shipped to"
                                                f" depot {n % 17} with {n * 3} crates.\n")
    return path


def test_a_load_into_a_serving_table_keeps_its_index_the_whole_time(conn, embedder, settings, tmp_path, monkeypatch):
    """A source that more than doubles the model's table used to drop its HNSW index for the load: every search of
    every source was an exact scan until the load ended (issue 27, item 12). The index now serves throughout; the
    check runs at every batch of the load, from another connection (deterministic: a progress hook, not a timer)."""
    from pipelines.ingest.report import NO_PROGRESS, Progress
    from pipelines.storage.database import connect

    monkeypatch.setattr(vector_store, "DEFER_INDEX_MIN_ROWS", 10)
    add_source(conn, declare("small", _distinct_folder(tmp_path / "small", 12)), "tests")
    ingest(conn, embedder, settings, ["small"])  # the first load into an empty table may build its index after
    table = vector_store.table_name(embedder.model_key)
    before = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))).fetchone()[0]
    seen = []

    class Watch(Progress):
        def advance(self, count: int = 1) -> None:
            with connect(settings) as other:
                seen.append(hnsw_index(other, table) is not None)

    add_source(conn, declare("large", _distinct_folder(tmp_path / "large", 60)), "tests")
    summary = ingest(conn, embedder, dataclasses.replace(settings, embed_batch_size=8), ["large"],
                     progress=lambda stage: Watch() if stage == "embed" else NO_PROGRESS)
    report = summary.stage("embed")
    assert report.counts["computed"] >= 2 * before and report.counts["index_deferred"] == 0  # more than doubled
    assert len(seen) >= 5 and all(seen), seen


def test_a_backfill_shard_is_a_run_that_holds_the_locks_and_is_recorded(conn, embedder, settings):
    """The model backfill embedded with no lock and no record (issue 27, item 14): its shards are now the embed
    stage of runs over every source, under shared locks (side by side, never beside a refresh), on one row."""
    from pipelines.ingest.flow import stage
    from pipelines.ingest.run import IngestRun
    from pipelines.storage.database import connect
    from pipelines.storage.locks import LOCK_NAMESPACE

    add_source(conn, declare("samples", SAMPLES_DIR / "docs"), "tests")
    ingest(conn, embedder, settings, ["samples"])
    with connect(settings) as refresh:
        refresh.execute("SELECT pg_advisory_lock(%s, hashtext('samples'))", (LOCK_NAMESPACE,))  # a refresh runs
        conn.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            with IngestRun.open(conn, settings, embedder, started_by="dagster", external_run_id="bf", shard="3"):
                pass
        conn.execute("RESET lock_timeout")
    assert conn.execute("SELECT count(*) FROM ingest_runs WHERE external_run_id = 'bf'").fetchone()[0] == 0
    with connect(settings) as second, \
            IngestRun.open(conn, settings, embedder, started_by="dagster", external_run_id="bf", shard="3") as one, \
            IngestRun.open(second, settings, embedder, started_by="dagster", external_run_id="bf", shard="4") as two:
        one.run_stage(stage("embed"))  # both shards hold the lock at once
        two.run_stage(stage("embed"))
    stages, counters = conn.execute("SELECT stages, counters FROM ingest_runs WHERE external_run_id = 'bf'").fetchone()
    assert sorted(stages) == ["embed:3", "embed:4"] and counters["outcome"] == "succeeded"
    assert counters["embeddings_computed"] == 0  # the serving model has every vector: nothing to embed, recorded
