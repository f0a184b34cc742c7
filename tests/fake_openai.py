"""A local HTTP server that speaks the OpenAI embeddings API, for tests of the real `openai` client."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

DIMENSIONS = 8


def fake_vector(text: str, dimensions: int = DIMENSIONS) -> list[float]:
    seed = int.from_bytes(text.encode()[:16].ljust(16, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed + len(text)).normal(size=dimensions).tolist()


class FakeOpenAI:
    """Scripted failures first (status codes, or 'hang'), then correct answers; records what it saw."""

    def __init__(self, failures=(), delay_s: float = 0.0, chat_reply: str = "[]", dimensions: int = DIMENSIONS,
                 zero_when=lambda text: False):
        self.failures = list(failures)
        self.zero_when = zero_when  # texts answered with an all-zero vector, as a broken endpoint does
        self.dimensions = dimensions
        self.chat_reply = chat_reply
        self.prompts: list[str] = []
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
                    if self.path.endswith("/chat/completions"):
                        fake.prompts.append(body["messages"][-1]["content"])
                        payload = json.dumps({
                            "id": "chat-1", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": fake.chat_reply}}]}).encode()
                        self.send_response(200)
                    elif failure:
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
                            "data": [{"object": "embedding", "index": i,
                                      "embedding": [0.0] * fake.dimensions if fake.zero_when(t) else fake_vector(t, fake.dimensions)}
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
