"""The OpenAI path against a local HTTP server that speaks the embeddings API: the real `openai` client,
batching, bounded concurrency and retries (429 with Retry-After, 5xx, timeouts) all run for real."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from fake_openai import DIMENSIONS, FakeOpenAI, fake_vector, openai_settings

from pipelines.ingest.run import ingest
from pipelines.models.embedders import OpenAIEmbedder, make_embedder
from pipelines.settings import SAMPLES_DIR
from pipelines.sources.declarations import add_source, declare


def test_batches_keep_input_order_and_vectors_are_normalised(settings):
    with FakeOpenAI() as fake:
        embedder = OpenAIEmbedder(openai_settings(settings, fake, openai_batch_size=3))
        texts = [f"passage number {i}" for i in range(10)]
        vectors = embedder.embed(texts)
    assert sorted(fake.batches) == [1, 3, 3, 3]
    expected = np.array([fake_vector(t) for t in texts])
    expected /= np.linalg.norm(expected, axis=1, keepdims=True)
    assert np.allclose(vectors, expected, atol=1e-6)
    assert embedder.model_key == "openai:fake-embed:8"


def test_429_with_retry_after_and_5xx_are_retried(settings):
    with FakeOpenAI(failures=[429, 503]) as fake:
        embedder = OpenAIEmbedder(openai_settings(settings, fake, openai_concurrency=1))
        vectors = embedder.embed(["one", "two"])
    assert vectors.shape == (2, DIMENSIONS)
    assert len(fake.attempt_times) == 3
    assert fake.attempt_times[1] - fake.attempt_times[0] >= 0.9, "Retry-After: 1 was not honoured"


def test_timeouts_are_retried(settings):
    with FakeOpenAI(failures=["hang"]) as fake:
        embedder = OpenAIEmbedder(openai_settings(settings, fake, openai_timeout_s=0.5, openai_concurrency=1))
        assert embedder.embed(["late"]).shape == (1, DIMENSIONS)
    assert len(fake.attempt_times) == 2


def test_too_many_failures_raise(settings):
    with FakeOpenAI(failures=[500] * 5) as fake:
        embedder = OpenAIEmbedder(openai_settings(settings, fake, openai_max_retries=1, openai_concurrency=1))
        with pytest.raises(Exception, match="500|Internal|slow down"):
            embedder.embed(["x"])


def test_concurrency_is_bounded(settings):
    with FakeOpenAI(meet=2, delay_s=0.2) as fake:  # the first waits for a second; held, a third would show
        embedder = OpenAIEmbedder(openai_settings(settings, fake, openai_batch_size=1, openai_concurrency=2))
        embedder.embed([f"t{i}" for i in range(8)])
    assert fake.max_in_flight == 2


def test_full_ingest_through_the_openai_path(conn, settings):
    with FakeOpenAI() as fake:
        openai = openai_settings(settings, fake)
        add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl", golden_set=SAMPLES_DIR / "golden.jsonl"), "tests")
        counters = ingest(conn, make_embedder(openai), openai).counters()
    assert counters["documents_published"] == 4
    assert counters["embeddings_computed"] == counters["chunks_inserted"]
    # Texts embedded: chunks, cards (the FAQ titles are questions), and the one query about faq in its golden set,
    # which the gate searches before the refresh is served.
    assert sum(fake.batches) == counters["chunks_inserted"] + counters["cards_written"] + 1
    assert counters["cards_written"] == 4
    assert conn.execute("SELECT vector_table FROM embedding_models").fetchone()[0] == "vectors_openai_fake_embed_8"


def test_a_process_given_another_endpoint_for_the_same_model_asks_the_new_one(conn, settings, monkeypatch):
    """Found by the full suite: the query embedder was cached by model key alone, so once one endpoint had served
    `openai:fake-embed:8`, a later configuration with another endpoint kept asking the first, gone, one."""
    from pipelines.retrieval import responses

    monkeypatch.setattr(responses, "_embedders", {})
    for _ in range(2):
        with FakeOpenAI() as fake:
            embedder = responses._query_embedder(conn, "openai:fake-embed:8", openai_settings(settings, fake))
            assert embedder.embed(["reset VPN token"]).shape == (1, DIMENSIONS)
        assert fake.batches == [1]


def test_a_key_rotated_in_a_running_process_is_sent_from_the_next_query_on(conn, settings, monkeypatch):
    """The query embedder was cached by model and endpoint: a server given the new key after a rotation (a second
    configuration in the same process) kept sending the revoked one, which a real endpoint refuses with 401."""
    from pipelines.retrieval import responses

    monkeypatch.setattr(responses, "_embedders", {})
    with FakeOpenAI() as fake:
        sent = []
        for key in ("old-key", "new-key"):
            rotated = dataclasses.replace(openai_settings(settings, fake), openai_api_key=key)
            responses._query_embedder(conn, "openai:fake-embed:8", rotated).embed(["reset VPN token"])
            sent.append(fake.keys[-1])
    assert sent == ["old-key", "new-key"]


def test_the_model_key_comes_from_the_configuration_never_from_the_endpoint(settings):
    with FakeOpenAI(dimensions=4) as fake:
        native = OpenAIEmbedder(dataclasses.replace(openai_settings(settings, fake), openai_dimensions=None))
        requested = OpenAIEmbedder(openai_settings(settings, fake))
        assert (native.model_key, requested.model_key) == ("openai:fake-embed:native", "openai:fake-embed:8")
        assert fake.attempt_times == [], "deriving a key asked the endpoint"
        assert native.dimensions == 4  # what a model not registered yet registers with: the endpoint's own length


@pytest.mark.parametrize("requested", [None, DIMENSIONS])
def test_an_endpoint_that_answers_another_dimension_for_one_run_changes_nothing(settings, tmp_path, monkeypatch,
                                                                                requested):
    """Issue 18: at 4-d for one run (no file of kb's changed) the new length became a new model that switched,
    retired the 8-d one and dropped its table; back at 8-d every ingest exited 1 and search answered 500."""
    import json

    from click.testing import CliRunner
    from fastapi.testclient import TestClient

    from pipelines.cli import main
    from pipelines.retrieval import responses
    from pipelines.serving.api import create_app
    from pipelines.settings import load_settings
    from pipelines.storage.database import connect

    def kb(*args: str, expect: int = 0) -> str:
        result = CliRunner().invoke(main, list(args))
        assert result.exit_code == expect, result.output
        return result.output

    def search_ok(query: str, expected: str) -> None:
        assert any(expected in c["content"] for c in json.loads(kb("search", query, "--json"))["chunks"])
        with TestClient(create_app(load_settings())) as client:
            response = client.get("/v1/knowledge/search", params={"q": query})
            assert response.status_code == 200, response.text
            assert response.json()["chunks"][0]["content"]

    def models() -> list[tuple]:
        with connect(load_settings()) as conn:
            rows = conn.execute("SELECT model_key, dimensions, state, to_regclass(vector_table) IS NOT NULL"
                                " FROM embedding_models").fetchall()
        return rows

    monkeypatch.setattr(responses, "_embedders", {})  # query embedders cached by earlier tests, for other endpoints
    records = tmp_path / "faq.jsonl"
    records.write_text((SAMPLES_DIR / "faq.jsonl").read_text())
    with FakeOpenAI(dimensions=DIMENSIONS) as fake:
        for name, value in {"KB_EMBEDDER": "openai", "KB_OPENAI_MODEL": "fake-embed", "OPENAI_BASE_URL": fake.base_url,
                            "OPENAI_API_KEY": "test-key"}.items():
            monkeypatch.setenv(name, value)
        if requested:
            monkeypatch.setenv("KB_OPENAI_DIMENSIONS", str(requested))
        kb("ingest", str(records), "--source", "faq", "--public")
        registered = models()
        assert [row[1:] for row in registered] == [(DIMENSIONS, "active", True)]

        fake.dimensions = 4
        records.write_text(records.read_text().replace("within 30 days", "within 45 days"))
        failed = kb("ingest", "--source", "faq", "--json", expect=3)
        assert "4-dimensional vectors; this model is registered with 8" in failed
        assert models() == registered, "a 4-d answer registered, switched or dropped a model"
        fake.dimensions = DIMENSIONS
        search_ok("expense claims deadline", "within 30 days")  # the document kept its last good version

        kb("ingest", "--source", "faq")
        assert models() == registered
        search_ok("expense claims deadline", "within 45 days")
