"""A local HTTP server that speaks the OpenAI embeddings API, for tests of the real `openai` client."""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import numpy as np

DIMENSIONS = 8


def fake_vector(text: str, dimensions: int = DIMENSIONS) -> list[float]:
    seed = int.from_bytes(text.encode()[:16].ljust(16, b"\0"), "little") % (2**32)
    return np.random.default_rng(seed + len(text)).normal(size=dimensions).tolist()


class FakeOpenAI:
    """Scripted failures first (status codes, or 'hang': no answer until the server stops, however long the client
    waits), then correct answers; records what it saw."""

    def __init__(self, failures=(), delay_s: float = 0.0, chat_reply: str = "[]", dimensions: int = DIMENSIONS,
                 zero_when=lambda text: False, chat=None, hold_after: int | None = None, meet: int = 1):
        self.failures = list(failures)
        # Embedding requests wait until `meet` of them have been in flight at once: a client that sends that many
        # concurrently is seen doing so however fast or slow the machine (`delay_s` then holds each one).
        self.meet, self.met = meet, threading.Event()
        # After this many chat prompts, later chat requests wait until the server stops: a client can then be
        # killed mid-generation deterministically (`held` is set once one is waiting).
        self.hold_after, self.held, self.release = hold_after, threading.Event(), threading.Event()
        self.chat = chat  # prompt -> reply, a scripted chat model (see scripted_chat); else chat_reply always
        self.zero_when = zero_when  # texts answered with an all-zero vector, as a broken endpoint does
        self.dimensions = dimensions
        self.chat_reply = chat_reply
        self.prompts: list[str] = []
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.attempt_times: list[float] = []
        self.keys: list[str] = []  # the API key each request was sent with
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                counted = True

                def finished():  # the request leaves the in-flight count once, before its reply can be read
                    nonlocal counted
                    with fake.lock:
                        if counted:
                            fake.in_flight -= 1
                            counted = False

                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.attempt_times.append(time.monotonic())
                    fake.keys.append(self.headers.get("Authorization", "").removeprefix("Bearer "))
                    failure = fake.failures.pop(0) if fake.failures else None
                    fake.in_flight += 1
                    fake.max_in_flight = max(fake.max_in_flight, fake.in_flight)
                    if fake.in_flight >= fake.meet:
                        fake.met.set()
                try:
                    if failure == "hang":
                        fake.release.wait(timeout=600)
                        return
                    if self.path.endswith("/chat/completions") and not failure:
                        prompt = body["messages"][-1]["content"]
                        with fake.lock:
                            fake.prompts.append(prompt)
                            hold = fake.hold_after is not None and len(fake.prompts) > fake.hold_after
                        if hold:
                            fake.held.set()
                            fake.release.wait(timeout=600)
                            return
                        reply = fake.chat(prompt) if fake.chat else fake.chat_reply
                        payload = json.dumps({
                            "id": "chat-1", "object": "chat.completion", "created": 0, "model": body["model"],
                            "choices": [{"index": 0, "finish_reason": "stop",
                                         "message": {"role": "assistant", "content": reply}}]}).encode()
                        self.send_response(200)
                    elif failure:
                        payload = json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}).encode()
                        self.send_response(failure)
                        if failure == 429:
                            self.send_header("Retry-After", "1")
                    else:
                        fake.met.wait(timeout=60)
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
                    # The client may send its next request as soon as it has this reply: counted until after the
                    # write, that request found this one still in flight (3 where the client held 2, on a busy host).
                    finished()
                    self.end_headers()
                    self.wfile.write(payload)
                finally:
                    finished()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def openai_settings(settings, fake, **overrides):
    return dataclasses.replace(settings, embedder="openai", openai_model="fake-embed", openai_base_url=fake.base_url,
                               openai_api_key="test-key", openai_dimensions=DIMENSIONS, **overrides)


_WORD = re.compile(r"[a-z0-9]{4,}")
_COMMON = {"what", "which", "does", "many", "much", "when", "where", "with", "that", "this", "have", "from", "there",
           "their", "your", "about", "into", "long", "often", "should", "would", "could", "must", "after", "before",
           "company", "northwind", "robotics", "employee", "employees"}


def scripted_chat(citing: str = "best") -> "Callable[[str], str]":
    """A deterministic stand-in for a chat model, reading kb's own prompts:
    - card prompts: one card per passage, its first sentence as the answer;
    - answer prompts: the context sharing most words with the question, its first sentence, cited as [n], or
      NOT_FOUND when no context holds three fifths of the question's words (compared by their first five letters);
    - HyDE prompts: a short passage made of the question's words;
    - a question kb says asks yes or no: "Yes." as a sentence of its own, uncited, before the cited sentence.
    `citing` makes it misbehave the way small models do: "missing" cites [99], "none" cites nothing, "wrong" cites
    the next context instead of the right one, "all" cites every context (the prompt's "[1], [2] and so on"),
    "label" copies a source label from nowhere into the sentence, "prose" always declines in prose ("The answer is
    not found.", never NOT_FOUND), "invent" always answers, with a figure no context holds."""
    def reply(prompt: str) -> str:
        if prompt.startswith("Write up to"):
            passage = prompt.split("Passage:\n", 1)[1].strip().split("\n\n")[-1]
            first = re.split(r"(?<=[.!?])\s+", passage)[0]
            return json.dumps([{"question": "What does the passage say about " + " ".join(first.split()[:6]) + "?",
                                "answer": first}])
        if prompt.startswith("Write a short passage"):
            return "This passage answers: " + prompt.rsplit(":", 1)[1].strip()
        question = prompt.split("Question: ", 1)[1].split("\n", 1)[0]
        def stems(text: str) -> set[str]:
            return {word[:5] for word in _WORD.findall(text.lower()) if word not in _COMMON}

        wanted = stems(question)
        contexts = re.findall(r"^\[(\d+)\] \[[^\]]*\] (.*)$", prompt, re.M)
        scored = sorted(((len(wanted & stems(text)), int(n), text) for n, text in contexts), key=lambda t: (-t[0], t[1]))
        if citing in ("invent", "prose"):  # whatever the contexts say
            return "Employees are entitled to 37 days of it every year [1]." if citing == "invent" else (
                "The answer is not found.")
        if not scored or scored[0][0] < 0.6 * len(wanted):
            return "NOT_FOUND"
        _, n, text = scored[0]
        sentence = re.split(r"(?<=[.!?])\s+", text)[0]
        others = [int(m) for m, _ in contexts if int(m) != n]
        verdict = "Yes. " if "asks yes or no" in prompt else ""  # the verdict alone, uncited, as models write it
        return verdict + sentence + {"best": f" [{n}]", "missing": " [99]", "none": "",
                           "wrong": f" [{others[0] if others else n}]",
                           "all": " " + ", ".join(f"[{m}]" for m, _ in contexts),
                           "label": f" [hr:salaries.md, Bands] [{n}]"}[citing]
    return reply
