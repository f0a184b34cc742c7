"""The OpenAI path against a local HTTP server that speaks the embeddings API: the real `openai` client,
batching, bounded concurrency and retries (429 with Retry-After, 5xx, timeouts) all run for real."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from pipelines.embedders import OpenAIEmbedder, make_embedder
from pipelines.extract import register_source, source_for_path
from pipelines.ingest import ingest
from pipelines.settings import SAMPLES_DIR

DIMENSIONS = 8


def fake_vector(text: str) -> list[float]:
    seed = int.from_bytes(text.encode()[:16].ljust(16, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed + len(text)).normal(size=DIMENSIONS).tolist()


class FakeOpenAI:
    """Scripted failures first (status codes, or 'hang'), then correct answers; records what it saw."""

    def __init__(self, failures=(), delay_s: float = 0.0):
        self.failures = list(failures)
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.attempt_times: list[float] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.attempt_times.append(time.monotonic())
                    failure = fake.failures.pop(0) if fake.failures else None
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                try:
                    if failure == "hang":
                        time.sleep(1.5)
                        return
                    if failure:
                        payload = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
                        self.send_response(failure)
                        if failure == 429:
                            self.send_header("Retry-After", "1")
                    else:
                        time.sleep(fake.delay_s)
                        inputs = body["input"]
                        with fake.lock:
                            fake.batches.append(len(inputs))
                        payload = json.dumps({
                            "object": "list", "model": body["model"],
                            "data": [{"object": "embedding", "index": i, "embedding": fake_vector(t)}
                                     for i, t in reversed(list(enumerate(inputs)))],
                            "usage": {"prompt_tokens": 1, "total_tokens": 1}}).encode()
                        self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def openai_settings(settings, fake, **overrides):
    return dataclasses.replace(settings, embedder="openai", openai_model="fake-embed", openai_base_url=fake.base_url,
                               openai_api_key="test-key", openai_dimensions=DIMENSIONS, **overrides)


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
        register_source(conn, source_for_path(SAMPLES_DIR / "faq.jsonl", "faq"))
        counters = ingest(conn, make_embedder(openai), openai).counters()
    assert counters["documents_published"] == 4
    assert counters["embeddings_computed"] == counters["chunks_inserted"] == sum(fake.batches)
    assert conn.execute("SELECT vector_table FROM embedding_models").fetchone()[0] == "vectors_openai_fake_embed_8"
