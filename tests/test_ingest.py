"""End to end on a real PostgreSQL: the sample corpus in, searchable chunks out; re-runs write nothing."""

import json
import os

import numpy as np
from click.testing import CliRunner

from pipelines.cli import main
from pipelines.ingest.run import EXIT_FILE_FAILURES, ingest
from pipelines.models.embedders import OnnxEmbedder
from pipelines.retrieval.search import dense_search
from pipelines.settings import SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare
from pipelines.storage.vectors import table_name

VECTORS = table_name(OnnxEmbedder.model_key)
CONTENT_TABLES = ("documents", "elements", "chunks", "chunk_drafts", VECTORS)


class CountingEmbedder:
    """The real local model, counting the texts it is asked to embed."""

    def __init__(self, inner):
        self.inner, self.texts = inner, 0
        self.model_key, self.dimensions, self.counter = inner.model_key, inner.dimensions, inner.counter

    def embed(self, texts):
        self.texts += len(texts)
        return self.inner.embed(texts)


def snapshot(conn) -> dict:
    """Every row of every content table with its xmin: a rewritten row shows even if its values are equal."""
    return {t: conn.execute(f"SELECT xmin::text, t::text FROM {t} t ORDER BY 2").fetchall() for t in CONTENT_TABLES}


def ingest_samples(conn, embedder, docs=SAMPLES_DIR / "docs"):
    add_source(conn, declare("samples", docs), "tests")
    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl"), "tests")
    return ingest(conn, embedder, load_settings())


def test_sample_corpus_is_ingested_with_chunks_metadata_and_vectors(conn, embedder):
    summary = ingest_samples(conn, embedder)
    counters = summary.counters()
    assert summary.failures == []
    assert counters["documents_seen"] == counters["documents_new"] == counters["documents_published"] == 13
    assert counters["chunks_inserted"] == counters["embeddings_computed"] > 13

    formats = dict(conn.execute("SELECT doc_format, count(*) FROM documents GROUP BY 1").fetchall())
    assert formats == {"md": 1, "html": 1, "txt": 1, "csv": 1, "xlsx": 1, "docx": 1, "pptx": 1, "pdf": 1, "eml": 1,
                       "record": 4}
    # Every live chunk: raw text stored apart from the embedded text, which starts with the document title.
    rows = conn.execute("SELECT d.title, c.text, c.embed_text, c.token_count FROM chunks c JOIN documents d"
                        " USING (document_id) WHERE c.valid_to IS NULL").fetchall()
    for title, text, embedded, tokens in rows:
        assert embedded.startswith(title) and embedded.endswith(text)
        assert 0 < tokens == embedder.counter.count([embedded])[0] <= 254  # tables and cards included
    # Entities are filterable through the JSONB index.
    hits = conn.execute("SELECT DISTINCT d.locator FROM chunks c JOIN documents d USING (document_id)"
                        " WHERE c.entities @> '{\"codes\": [\"HR-2024-047\"]}'").fetchall()
    assert hits == [("handbook/leave-policy.md",)]
    # Vectors: one per distinct embedded text, unit length, 384-d.
    vectors = conn.execute(f"SELECT embedding FROM {VECTORS}").fetchall()
    assert len(vectors) == conn.execute("SELECT count(DISTINCT text_hash) FROM chunks").fetchone()[0]
    norms = np.linalg.norm(np.array([np.asarray(v[0].to_numpy()) for v in vectors]), axis=1)
    assert np.allclose(norms, 1, atol=1e-3) and len(vectors[0][0].to_numpy()) == 384

    top = dense_search(conn, embedder, "how many weeks of paid leave for a new parent", k=3)
    assert top[0].document == "handbook/leave-policy.md"


def test_a_document_the_chunker_fails_on_fails_alone_and_the_run_goes_on(conn, embedder, monkeypatch):
    from pipelines.ingest.chunker import Chunker

    chunk = Chunker.chunk

    def failing_on_the_handbook(self, elements, title):  # a chunker bug that one document meets
        if "Family Leave" in (title or ""):
            raise RecursionError("maximum recursion depth exceeded")
        return chunk(self, elements, title)

    monkeypatch.setattr(Chunker, "chunk", failing_on_the_handbook)
    summary = ingest_samples(conn, embedder)
    assert [(f.locator, f.stage) for f in summary.failures] == [("handbook/leave-policy.md", "chunk")]
    assert "cannot chunk: RecursionError" in summary.failures[0].reason
    assert summary.counters()["documents_published"] == 12


def test_a_draft_enriched_again_is_counted_afresh(conn, embedder):
    """Drafts enriched in a run whose embedding failed, then enriched again by a newer enricher: their stored count
    is of the old embedded text, so the new one is counted whole, not prefix + that count."""
    from pipelines.ingest.enrich import enrich_pending

    class Down:  # an embedding endpoint that is down
        model_key, dimensions, counter = embedder.model_key, embedder.dimensions, embedder.counter

        def embed(self, texts):
            raise ConnectionError("the embedding endpoint is down")

    try:
        ingest_samples(conn, Down())
    except Exception:
        pass
    assert conn.execute("SELECT count(*) FROM chunk_drafts WHERE embed_text IS NOT NULL").fetchone()[0] > 13
    conn.execute("UPDATE chunk_drafts SET enrich_version = 'enrich-1'")  # an older enricher's
    enrich_pending(conn, embedder.counter)
    rows = conn.execute("SELECT embed_text, token_count FROM chunk_drafts ORDER BY document_id, ordinal").fetchall()
    assert [tokens for _, tokens in rows] == embedder.counter.count([text for text, _ in rows])


def test_second_run_writes_nothing_and_embeds_nothing(conn, embedder):
    ingest_samples(conn, embedder)
    before = snapshot(conn)
    counting = CountingEmbedder(embedder)
    counters = ingest_samples(conn, counting).counters()
    assert counting.texts == 0
    assert counters["documents_unchanged"] == 13 and counters["documents_changed"] == counters["documents_new"] == 0
    assert counters["chunks_written"] == counters["embeddings_computed"] == 0
    assert snapshot(conn) == before


def test_a_first_publish_leaves_the_planner_statistics_of_what_it_wrote(conn, embedder):
    """The migrations analyzed the tables empty; a first ingest must not leave the planner believing that while the
    calibrate stage, the gate and the first users search them (autovacuum would catch up only a minute later)."""
    def believed() -> dict:
        return dict(conn.execute("SELECT relname, reltuples FROM pg_class WHERE relname = ANY(%s)",
                                 (["chunks", "lexical_postings", VECTORS],)).fetchall())

    assert believed()["chunks"] <= 0  # the migrations' statistics: empty
    summary = ingest_samples(conn, embedder)
    rows = {table: conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0] for table in believed()}
    # Analyzed whole (they are small) when the publish committed; the cards stage added a few chunks since.
    assert all(believed()[table] > 0.8 * rows[table] for table in rows), (believed(), rows)
    publish = next(r for r in summary.stages if r.stage == "publish")
    assert set(publish.notes["analyzed"]) >= {"chunks", "lexical_postings", VECTORS}

    again = ingest_samples(conn, embedder)  # wrote nothing: nothing to analyze
    assert "analyzed" not in next(r for r in again.stages if r.stage == "publish").notes


def test_the_statistics_never_wait_on_maintenance(conn, settings):
    """An operator's VACUUM (or an index build) holds a table: the run does not wait for it; autovacuum analyzes that
    table later, and the others are analyzed now."""
    from pipelines.storage.database import connect as open_connection
    from pipelines.storage.statistics import analyze_if_stale

    conn.execute("SET statement_timeout = '120s'")  # a run that waited would fail here, not hang the suite
    with open_connection(settings) as maintenance, maintenance.transaction():
        maintenance.execute("LOCK TABLE lexical_postings IN SHARE UPDATE EXCLUSIVE MODE")  # what VACUUM takes
        assert analyze_if_stale(conn, chunks_written=1) == ["documents", "chunks", "lexical_terms"]


def test_touched_but_identical_file_is_not_reparsed(conn, embedder, samples_copy):
    ingest_samples(conn, embedder, samples_copy)
    os.utime(samples_copy / "handbook/leave-policy.md", (1_700_000_000, 1_700_000_000))
    counters = ingest_samples(conn, embedder, samples_copy).counters()
    assert counters["documents_unchanged"] == 13
    assert ingest_samples(conn, embedder, samples_copy).stage("parse").counts["parsed"] == 0


def test_bad_files_fail_one_by_one_and_the_rest_is_ingested(conn, embedder, samples_copy):
    (samples_copy / "empty.txt").write_bytes(b"")
    (samples_copy / "corrupt.pdf").write_bytes(b"%PDF-1.4\n this is not really a pdf")
    (samples_copy / "blank.html").write_text("<html><body><p> </p></body></html>")
    (samples_copy / "gone.md").symlink_to(samples_copy / "does-not-exist.md")
    summary = ingest_samples(conn, embedder, samples_copy)
    reasons = {f.locator: f.reason for f in summary.failures}
    assert set(reasons) == {"empty.txt", "corrupt.pdf", "blank.html", "gone.md"}
    assert "empty file" in reasons["empty.txt"]
    assert "parsed to no text" in reasons["blank.html"]
    assert "is a symbolic link" in reasons["gone.md"]  # a dangling link is a link: never followed
    assert "corrupt.pdf" in reasons["corrupt.pdf"]
    for locator, reason in reasons.items():
        assert str(samples_copy / locator) in reason, "the reason must name the file"
    published = conn.execute("SELECT count(*) FROM documents WHERE published_key IS NOT NULL").fetchone()[0]
    assert published == 13
    recorded = {r[0] for r in conn.execute("SELECT locator FROM failures")}
    assert recorded == set(reasons)


def test_a_file_that_breaks_keeps_its_last_good_version(conn, embedder, samples_copy):
    ingest_samples(conn, embedder, samples_copy)
    chunks = lambda: conn.execute(  # noqa: E731
        "SELECT c.text FROM chunks c JOIN documents d USING (document_id)"
        " WHERE d.locator = 'finance/expense-policy.docx' AND c.valid_to IS NULL ORDER BY c.ordinal").fetchall()
    good = chunks()
    (samples_copy / "finance/expense-policy.docx").write_bytes(b"truncated upload")
    summary = ingest_samples(conn, embedder, samples_copy)
    assert [f.locator for f in summary.failures] == ["finance/expense-policy.docx"]
    assert chunks() == good
    assert dense_search(conn, embedder, "daily meal allowance when travelling", k=1)[0].document == "finance/expense-policy.docx"


def test_cli_ingest_json_reports_counters_errors_and_exit_status(settings, samples_copy):
    (samples_copy / "empty.md").write_bytes(b"")
    runner = CliRunner()
    result = runner.invoke(main, ["ingest", str(samples_copy), "--source", "handbook", "--public", "--json"])
    assert result.exit_code == EXIT_FILE_FAILURES, result.output
    data = json.loads(result.stdout)
    assert data["documents_seen"] == 10 and data["documents_new"] == 9 and data["documents_failed"] == 1
    assert data["errors"][0]["file"] == "empty.md" and "empty file" in data["errors"][0]["reason"]
    assert data["embeddings_computed"] == data["chunks_written"] > 0

    again = runner.invoke(main, ["ingest", str(samples_copy / "handbook"), "--source", "hb", "--public", "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["errors"] == []

    found = runner.invoke(main, ["search", "fault code for encoder signal lost", "--k", "2", "--json"])
    assert found.exit_code == 0
    assert len(json.loads(found.stdout)["chunks"]) == 2

    status = runner.invoke(main, ["status", "--json"])
    sources = {s["source_id"]: s for s in json.loads(status.stdout)["sources"]}
    # hb lies inside handbook's folder: its files moved to it when it was declared (a file belongs to one source)
    assert sources["hb"]["documents"] >= 1 and sources["handbook"]["failed"] == 1
    assert sources["handbook"]["documents"] + sources["hb"]["documents"] == 9


def test_cli_usage_errors_exit_2(settings):
    result = CliRunner().invoke(main, ["ingest", "/no/such/folder"])
    assert result.exit_code == 2


def test_a_file_that_never_published_is_not_counted_deleted_when_it_goes(conn, embedder, samples_copy):
    (samples_copy / "broken.docx").write_bytes(b"not a zip archive")
    first = ingest_samples(conn, embedder, samples_copy).counters()
    assert first["documents_new"] == 14 and first["documents_failed"] == 1 and first["documents_published"] == 13
    (samples_copy / "broken.docx").unlink()
    (samples_copy / "handbook" / "leave-policy.md").unlink()
    again = ingest_samples(conn, embedder, samples_copy).counters()
    assert again["documents_deleted"] == 1 and again["documents_failed"] == 0  # the served one only


def test_the_same_document_twice_in_a_source_is_ingested(conn, embedder, tmp_path):
    """Two copies of one text (a PDF and its DOCX, a file copied into another folder) make identical chunks in one
    cards batch; their Q&A cards were cached twice and the run failed on card_cache's key."""
    folder = tmp_path / "copies"
    (folder / "old").mkdir(parents=True)
    text = "# Returns\n\n## How do I return an item?\n\nSend it back within 30 days with the receipt.\n"
    (folder / "returns.md").write_text(text)
    (folder / "old" / "returns.md").write_text(text)
    add_source(conn, declare("copies", folder), "tests")
    summary = ingest(conn, embedder, load_settings(), ["copies"])
    assert summary.failures == [] and summary.counters()["documents_published"] == 2
    hashes = conn.execute("SELECT count(*), count(DISTINCT c.text_hash) FROM chunks c JOIN documents d"
                          " USING (document_id) WHERE d.source_id = 'copies' AND c.kind <> 'card'").fetchone()
    assert hashes[0] == 2 * hashes[1] > 0
