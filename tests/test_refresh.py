"""Incremental refresh scenarios on a real PostgreSQL: edits, metadata-only changes, deletes and restores,
chunker and model changes, crashes and concurrent runs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from deadline import killed_after

from pipelines.ingest import chunk as drafts
from pipelines.ingest import publish
from pipelines.ingest.flow import stage
from pipelines.ingest.run import IngestRun, ingest
from pipelines.models.embedders import OnnxEmbedder
from pipelines.retrieval.search import dense_search
from pipelines.settings import SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare
from pipelines.sources.staleness import sweep
from pipelines.storage.database import connect
from pipelines.storage.history import document_history, purge_history
from pipelines.storage.locks import source_locks
from pipelines.storage.vectors import active_model, model_tables, table_name

POLICY = "handbook/leave-policy.md"
VECTORS = table_name(OnnxEmbedder.model_key)


class CountingEmbedder:
    def __init__(self, inner):
        self.inner, self.texts = inner, []
        self.model_key, self.dimensions, self.counter = inner.model_key, inner.dimensions, inner.counter

    def embed(self, texts):
        self.texts += texts
        return self.inner.embed(texts)


def run(conn, embedder, docs):
    add_source(conn, declare("samples", docs), "tests")
    counting = CountingEmbedder(embedder)
    summary = ingest(conn, counting, load_settings(), ["samples"])
    return summary.counters(), counting.texts


def live_texts(conn, locator=POLICY):
    return [r[0] for r in conn.execute(
        "SELECT c.text FROM chunks c JOIN documents d USING (document_id) WHERE d.locator = %s AND c.valid_to IS NULL"
        " AND c.kind <> 'card'"
        " ORDER BY c.ordinal", (locator,))]


def test_editing_one_section_re_embeds_only_its_chunks_and_keeps_history(conn, embedder, samples_copy):
    run(conn, embedder, samples_copy)
    before = live_texts(conn)
    ids_before = dict(conn.execute("SELECT text, chunk_id FROM chunks WHERE valid_to IS NULL AND kind <> 'card'").fetchall())
    between = conn.execute("SELECT clock_timestamp()").fetchone()[0]  # the clock that stamps versions
    path = samples_copy / POLICY
    path.write_text(path.read_text().replace("up to 10 days of paid family care leave", "up to 12 days of paid family care leave"))

    counters, embedded = run(conn, embedder, samples_copy)
    assert counters["documents_changed"] == 1 and counters["documents_unchanged"] == 8
    assert len(embedded) == counters["embeddings_computed"] == 1 and "12 days" in embedded[0]
    assert counters["chunks_inserted"] == counters["chunks_closed"] == 1
    after = live_texts(conn)
    assert [t for t in after if t not in before] == [t for t in after if "12 days" in t]
    for text in after:  # untouched chunks keep their rows (and so their vectors)
        if text in ids_before:
            assert conn.execute("SELECT chunk_id FROM chunks WHERE text = %s AND valid_to IS NULL AND kind <> 'card'",
                                (text,)).fetchone()[0] == ids_before[text]
    closed = conn.execute("SELECT text FROM chunks WHERE valid_to IS NOT NULL").fetchall()
    assert len(closed) == 1 and "10 days" in closed[0][0]

    query = "how many days of family care leave per year"
    now_hit = dense_search(conn, embedder, query, k=1)[0]
    old_hit = dense_search(conn, embedder, query, k=1, as_of=between)[0]
    assert "12 days" in now_hit.content and "10 days" in old_hit.content

    versions = document_history(conn, f"samples:{POLICY}")
    assert [(v["version"], v["event"], v["chunks_added"], v["chunks_closed"]) for v in versions] == [
        (1, "published", 8, 0), (2, "published", 1, 1)]
    assert versions[1]["chunks_kept"] == 7


def test_metadata_only_change_calls_no_model(conn, embedder, samples_copy):
    run(conn, embedder, samples_copy)
    path = samples_copy / "products/avx-series-manual.html"
    path.write_text(path.read_text().replace("Technical Publications", "Service Documentation Team"))
    counters, embedded = run(conn, embedder, samples_copy)
    assert counters["documents_changed"] == 1
    assert embedded == [] and counters["chunks_written"] == 0
    author = conn.execute("SELECT metadata->>'author' FROM documents WHERE locator = %s", ("products/avx-series-manual.html",)).fetchone()[0]
    assert author == "Northwind Robotics Service Documentation Team"


def test_delete_then_restore_re_embeds_nothing(conn, embedder, samples_copy):
    run(conn, embedder, samples_copy)
    path = samples_copy / POLICY
    content = path.read_bytes()
    path.unlink()
    counters, _ = run(conn, embedder, samples_copy)
    assert counters["documents_deleted"] == 1
    assert live_texts(conn) == []
    assert all(h.document != POLICY for h in dense_search(conn, embedder, "parental leave weeks", k=10))

    path.write_bytes(content)
    counters, embedded = run(conn, embedder, samples_copy)
    assert embedded == [] and counters["embeddings_computed"] == 0
    assert len(live_texts(conn)) == 8
    assert dense_search(conn, embedder, "parental leave weeks", k=1)[0].document == POLICY
    assert [v["event"] for v in document_history(conn, POLICY)] == ["published", "deleted", "published"]


def test_chunker_version_bump_rechunks_from_stored_elements_without_parsing(conn, embedder, samples_copy, monkeypatch):
    run(conn, embedder, samples_copy)
    monkeypatch.setattr(drafts, "CHUNKER_VERSION", "chunker-test-bump")
    monkeypatch.setattr(publish, "CHUNKER_VERSION", "chunker-test-bump")
    add_source(conn, declare("samples", samples_copy), "tests")
    summary = ingest(conn, CountingEmbedder(embedder), load_settings(), ["samples"])
    assert summary.stage("parse").counts["parsed"] == 0
    assert summary.stage("chunk").counts["documents"] == 9
    assert summary.counters()["embeddings_computed"] == 0  # same chunk texts: the vectors are reused
    versions = {r[0] for r in conn.execute("SELECT DISTINCT chunker_version FROM chunks WHERE valid_to IS NULL"
                                           " AND kind <> 'card'")}
    assert versions == {"chunker-test-bump"}


# What an older kb, or the same kb with an older unstructured, stored as the version of its parser.
OLDER_PARSER = "parse-0+unstructured-0.0.0"


def refresh(conn, embedder):
    """`kb ingest` of every declared source; the summary and the texts the model was asked to embed."""
    counting = CountingEmbedder(embedder)
    return ingest(conn, counting, load_settings()), counting.texts


def read_differently_by_an_older_parser(conn, locator: str, text: str, older: str) -> None:
    """Make one document's elements, and the chunks served from them, those of a parser that read `text` as `older`:
    its elements are rewritten, and its key cleared so that the next refresh re-chunks it from them."""
    conn.execute("UPDATE elements e SET text = replace(e.text, %s, %s) FROM documents d"
                 " WHERE d.document_id = e.document_id AND d.locator = %s AND e.text LIKE '%%' || %s || '%%'",
                 (text, older, locator, text))
    conn.execute("UPDATE documents SET published_key = NULL WHERE locator = %s", (locator,))


def latest_versions(conn) -> dict[str, int]:
    return dict(conn.execute("SELECT d.locator, max(v.version) FROM document_versions v JOIN documents d"
                             " USING (document_id) GROUP BY d.locator").fetchall())


def test_a_new_parser_version_re_parses_unchanged_documents_and_publishes_only_what_changed(
        conn, embedder, samples_copy, tmp_path):
    """An unstructured upgrade or a change of kb's parsing (here: the stored version set back by SQL) parses every
    file again from its unchanged bytes, and rebuilds every record's elements. A document the new parser reads as
    the old one did keeps its chunks and history; one it reads differently is re-chunked, its vectors reused where
    its text was embedded before, and published once. Nothing changed after that: the next refresh writes nothing."""
    from pipelines.ingest.parse import PARSER_VERSION

    faq = tmp_path / "faq.jsonl"
    faq.write_bytes((SAMPLES_DIR / "faq.jsonl").read_bytes())
    add_source(conn, declare("samples", samples_copy), "tests")
    add_source(conn, declare("faq", faq), "tests")
    refresh(conn, embedder)
    read_differently_by_an_older_parser(conn, POLICY, "family care leave", "family-care leave")
    read_differently_by_an_older_parser(conn, "faq-002", "within 30 days", "within thirty days")
    refresh(conn, embedder)
    assert any("family-care leave" in t for t in live_texts(conn))
    conn.execute("UPDATE documents SET parser_version = %s", (OLDER_PARSER,))
    versions = latest_versions(conn)

    summary, embedded = refresh(conn, embedder)
    counters = summary.counters()
    assert summary.failures == []
    assert counters["documents_unchanged"] == 13 and counters["documents_changed"] == 0  # no file changed
    assert summary.stage("parse").counts["parsed"] == 9  # every file, from its bytes
    assert summary.stage("parse").counts["same_elements"] == 8
    assert summary.stage("chunk").counts["documents"] == 2  # the policy and the record read differently
    assert embedded == []  # their chunks are back to texts embedded before: the vectors are reused
    assert counters["chunks_inserted"] == counters["chunks_closed"] == 2
    assert {loc for loc, v in latest_versions(conn).items() if v != versions[loc]} == {POLICY, "faq-002"}
    assert all(v == versions[loc] + 1 for loc, v in latest_versions(conn).items() if loc in (POLICY, "faq-002"))
    assert any("family care leave" in t for t in live_texts(conn))
    assert not any("family-care" in t for t in live_texts(conn))
    assert any("within 30 days" in t for t in live_texts(conn, "faq-002"))
    assert {r[0] for r in conn.execute("SELECT DISTINCT parser_version FROM documents")} == {PARSER_VERSION}

    rows = lambda: {t: conn.execute(f"SELECT xmin::text, t::text FROM {t} t ORDER BY 2").fetchall()  # noqa: E731
                    for t in ("documents", "elements", "chunks", "chunk_drafts", "document_versions")}
    before = rows()
    summary, embedded = refresh(conn, embedder)
    assert summary.stage("parse").counts["parsed"] == summary.stage("chunk").counts["documents"] == 0
    assert embedded == [] and rows() == before


def test_documents_stored_before_the_parser_version_are_parsed_once_and_not_republished(conn, embedder, samples_copy):
    """sql/016 leaves the documents of an existing knowledge base without a version (unknown): the next refresh parses
    them once; the same elements come out, so nothing is re-chunked or published, and the refresh after parses none."""
    from pipelines.ingest.parse import PARSER_VERSION

    run(conn, embedder, samples_copy)
    conn.execute("UPDATE documents SET parser_version = NULL")
    versions = latest_versions(conn)
    add_source(conn, declare("samples", samples_copy), "tests")
    summary = ingest(conn, embedder, load_settings(), ["samples"])
    assert summary.stage("parse").counts["parsed"] == summary.stage("parse").counts["same_elements"] == 9
    assert summary.stage("parse").counts["elements"] == summary.stage("chunk").counts["documents"] == 0
    assert latest_versions(conn) == versions
    assert {r[0] for r in conn.execute("SELECT DISTINCT parser_version FROM documents")} == {PARSER_VERSION}
    assert ingest(conn, embedder, load_settings(), ["samples"]).stage("parse").counts["parsed"] == 0


def test_a_re_parse_that_fails_keeps_the_last_good_version(conn, embedder, samples_copy, monkeypatch):
    """A document the new parser cannot read keeps its elements, chunks and history, and stays marked as parsed by
    the older parser; the rest of the refresh goes on."""
    from pipelines.ingest.parse import PARSER_VERSION

    office = {"finance/expense-policy.docx", "sales/q3-2024-review.pptx", "products/spare-parts-prices.xlsx"}
    run(conn, embedder, samples_copy)
    conn.execute("UPDATE documents SET parser_version = %s", (OLDER_PARSER,))
    served = {loc: live_texts(conn, loc) for loc in office}
    elements = conn.execute("SELECT count(*) FROM elements").fetchone()[0]
    versions = latest_versions(conn)
    monkeypatch.setenv("KB_MAX_UNZIPPED_MB", "0.001")  # the new parser refuses every office file

    add_source(conn, declare("samples", samples_copy), "tests")
    summary = ingest(conn, embedder, load_settings(), ["samples"])
    assert {f.locator for f in summary.failures} == office
    assert all("KB_MAX_UNZIPPED_MB" in f.reason for f in summary.failures)
    assert summary.stage("parse").counts["parsed"] == 6
    assert {loc: live_texts(conn, loc) for loc in office} == served
    assert conn.execute("SELECT count(*) FROM elements").fetchone()[0] == elements
    assert latest_versions(conn) == versions
    stored = dict(conn.execute("SELECT locator, parser_version FROM documents").fetchall())
    assert {loc for loc, v in stored.items() if v == OLDER_PARSER} == office
    assert {v for loc, v in stored.items() if loc not in office} == {PARSER_VERSION}


def test_model_switch_builds_beside_the_serving_model_and_switches_atomically(conn, embedder, samples_copy, settings):
    from fake_openai import FakeOpenAI, openai_settings

    from pipelines.ingest.embed import embed_pending
    from pipelines.models.embedders import OpenAIEmbedder
    from pipelines.storage.vectors import activate_if_complete, ensure_vector_store

    run(conn, embedder, samples_copy)
    old_table = model_tables(conn)[embedder.model_key]
    with FakeOpenAI() as fake:
        new = OpenAIEmbedder(openai_settings(settings, fake))
        ensure_vector_store(conn, new.model_key, new.dimensions)
        # Half a backfill (interrupted): search still answers from the serving model.
        embed_pending(conn, new, shards=list("01234567"))
        assert not activate_if_complete(conn, new.model_key)
        assert active_model(conn) == embedder.model_key
        new_table = model_tables(conn)[new.model_key]
        assert not hnsw_indexes(conn, new_table), "a model being built grows no HNSW index row by row"
        assert dense_search(conn, embedder, "fault code encoder signal lost", k=1)[0].document
        # Resume: only what is missing is embedded. A complete model still does not serve until an operator
        # switches: an ingest with it configured (one run's configuration) leaves the serving model alone.
        first_half = sum(fake.batches)
        embed_pending(conn, new)
        total = conn.execute("SELECT count(DISTINCT text_hash) FROM chunks WHERE valid_to IS NULL").fetchone()[0]
        assert sum(fake.batches) == total and first_half < total
        ingest(conn, new, openai_settings(settings, fake), ["samples"])
        assert active_model(conn) == embedder.model_key, "an ingest switched the serving model"
        # The operator's switch (the active_model asset): one transaction; the old model is retired, its table kept.
        assert activate_if_complete(conn, new.model_key)
        assert active_model(conn) == new.model_key
        assert hnsw_indexes(conn, new_table) == [f"{new_table}_hnsw"], "built once, before it serves"
        states = dict(conn.execute("SELECT model_key, state FROM embedding_models").fetchall())
        assert states == {embedder.model_key: "retired", new.model_key: "active"}
        assert hnsw_indexes(conn, old_table) == [f"{old_table}_hnsw"], "a retired model's table and index are kept"
        hits = dense_search(conn, new, "fault code encoder signal lost", k=3)
        assert len(hits) == 3
        # Switching back needs no re-embedding: nothing changed since, so the retired table is complete.
        assert activate_if_complete(conn, embedder.model_key) and active_model(conn) == embedder.model_key
        assert dense_search(conn, embedder, "fault code encoder signal lost", k=1)[0].document


def hnsw_indexes(conn, table: str) -> list[str]:
    return [r[0] for r in conn.execute("SELECT indexname FROM pg_indexes WHERE tablename = %s AND indexdef LIKE '%%hnsw%%'",
                                       (table,)).fetchall()]


CONTENT = {
    "documents": "SELECT source_id, locator, content_hash, parsed_hash, published_key, title, metadata, deleted_at IS NULL FROM documents",
    "elements": "SELECT d.locator, e.seq, e.category, e.text, e.section_path FROM elements e JOIN documents d USING (document_id)",
    "chunks": "SELECT d.locator, c.ordinal, c.text, c.embed_text, c.text_hash, c.entities, c.valid_to IS NULL FROM chunks c JOIN documents d USING (document_id)",
    "vectors": f"SELECT text_hash FROM {VECTORS}",
    "drafts": "SELECT document_id FROM chunk_drafts",
}


def content_of(conn) -> dict:
    return {name: sorted(map(repr, conn.execute(query).fetchall())) for name, query in CONTENT.items()}


def vectors_of(conn) -> dict:
    rows = conn.execute(f"SELECT text_hash, embedding FROM {VECTORS}").fetchall()
    return {h: v.to_numpy() for h, v in rows}


@pytest.mark.parametrize("kill_at", ["parse: ", "embed: "])
def test_a_run_killed_mid_way_converges_to_the_clean_state(settings, embedder, samples_copy, kill_at):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KB_EMBED_BATCH_SIZE": "8"}
    cmd = [str(Path(sys.executable).parent / "kb"), "ingest", str(samples_copy), "--source", "samples", "--public"]
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    with killed_after(proc):
        for line in proc.stderr:  # progress lines are plain on a pipe: kill as the chosen stage starts
            if line.partition(" ")[2].startswith(kill_at):  # after the line's time
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=600)
    assert proc.returncode == -signal.SIGKILL
    with connect(settings) as conn:
        assert conn.execute("SELECT count(*) FROM chunks").fetchone()[0] == 0  # nothing half-published
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=600).returncode == 0
    with connect(settings) as conn:
        resumed, resumed_vectors = content_of(conn), vectors_of(conn)
        conn.execute("TRUNCATE sources, documents, elements, chunk_drafts, chunks, failures, document_versions,"
                     f" lexical_postings, lexical_postings_closed, lexical_terms, {VECTORS} RESTART IDENTITY CASCADE")
        conn.execute("UPDATE lexical_stats SET chunks = 0, total_length = 0")
        add_source(conn, declare("samples", samples_copy), "tests")
        ingest(conn, embedder, load_settings(), ["samples"])
        assert content_of(conn) == resumed
        # Same texts, same vectors up to batch composition: the int8 model quantizes activations per batch, so
        # a text's vector moves by quantization noise with its batch peers (cosine >= 0.99), no more.
        clean = vectors_of(conn)
        assert clean.keys() == resumed_vectors.keys()
        assert all(float(np.dot(clean[h], resumed_vectors[h])) >= 0.99 for h in clean)


def test_two_concurrent_runs_of_one_source_do_the_work_once(settings, embedder, samples_copy):
    counters, errors = [], []

    def one_run():
        try:
            with connect(settings) as conn, source_locks(conn, ["samples"]):
                add_source(conn, declare("samples", samples_copy), "tests")
                counters.append(ingest(conn, embedder, load_settings(), ["samples"]).counters())
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=one_run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == [] and not any(t.is_alive() for t in threads)
    assert sorted(c["documents_new"] for c in counters) == [0, 9]
    assert sorted(c["embeddings_computed"] for c in counters)[0] == 0
    with connect(settings) as conn:
        live = conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NULL").fetchone()[0]
        assert live == conn.execute("SELECT count(*) FROM chunks").fetchone()[0]
        assert [r[0] for r in conn.execute("SELECT count(*) FROM document_versions GROUP BY document_id")] == [1] * 9


def test_staleness_sweep_flags_sources_not_crawled_in_time_and_retention_purges(conn, embedder, samples_copy):
    run(conn, embedder, samples_copy)
    assert sweep(conn, timedelta(hours=1))["stale_documents"] == 0
    conn.execute("UPDATE sources SET last_crawled_at = now() - interval '3 days'")
    result = sweep(conn, timedelta(hours=24))
    assert result["stale_documents"] == 9 and result["sources"][0]["stale_documents"] == 9
    run(conn, embedder, samples_copy)  # a crawl makes the source fresh again
    assert sweep(conn, timedelta(hours=24))["stale_documents"] == 0

    path = samples_copy / POLICY
    path.write_text(path.read_text().replace("20 weeks", "22 weeks"))
    run(conn, embedder, samples_copy)
    assert purge_history(conn, 30)["chunks_purged"] == 0
    conn.execute("UPDATE chunks SET valid_to = valid_to - interval '40 days' WHERE valid_to IS NOT NULL")
    # A draft embedded but not yet published (a refresh between its embed and publish stages) keeps its vector.
    path.write_text(path.read_text().replace("22 weeks", "24 weeks"))
    with IngestRun.open(conn, load_settings(), embedder, ["samples"]) as draft:
        for name in ("extract", "parse", "chunk", "enrich", "embed"):
            draft.run_stage(stage(name))
    drafted = conn.execute("SELECT count(DISTINCT text_hash) FROM chunk_drafts").fetchone()[0]
    purged = purge_history(conn, 30)
    assert purged == {"chunks_purged": 1, "vectors_purged": 1}
    assert conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NOT NULL").fetchone()[0] == 0
    assert drafted and conn.execute(f"SELECT count(*) FROM chunk_drafts d JOIN {VECTORS} v USING (text_hash)"
                                    ).fetchone()[0] == conn.execute("SELECT count(*) FROM chunk_drafts").fetchone()[0]


def test_publish_batches_are_bounded_by_drafts_as_well_as_documents():
    """Issue 32: publish batches grew from 64 documents to BATCH_CHUNKS drafts; a batch's drafts in memory stay
    bounded however long its documents are, and a document longer than the bound is a batch of its own."""
    from pipelines.ingest.publish import BATCH_CHUNKS, _batches

    ready = [(1, "a", BATCH_CHUNKS + 5), (2, "b", BATCH_CHUNKS // 2), (3, "c", BATCH_CHUNKS // 2), (4, "d", 1)]
    assert list(_batches(ready, 1_000)) == [[(1, "a")], [(2, "b"), (3, "c")], [(4, "d")]]
    assert [len(b) for b in _batches([(n, "h", 1) for n in range(25)], 10)] == [10, 10, 5]
