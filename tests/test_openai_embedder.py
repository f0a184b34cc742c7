"""The OpenAI path against a local HTTP server that speaks the embeddings API: the real `openai` client,
batching, bounded concurrency and retries (429 with Retry-After, 5xx, timeouts) all run for real."""

from __future__ import annotations

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
    with FakeOpenAI(delay_s=0.2) as fake:
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
