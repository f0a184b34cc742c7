"""Optional stages after fusion: a reranker (local cross-encoder or a listwise LLM), MMR diversity and a
freshness boost. All are off unless configured; each takes the fused candidates and returns them reordered."""

from __future__ import annotations

import json
import math
import re
from datetime import date
from functools import cached_property
from typing import Protocol

import numpy as np
import psycopg
from psycopg import sql

from pipelines.models.chat import complete, openai_client
from pipelines.retrieval.search import Hit
from pipelines.settings import Settings
from pipelines.storage.vectors import vector_table


class Reranker(Protocol):
    def rerank(self, query: str, hits: list[Hit]) -> list[Hit]: ...


class CrossEncoderReranker:
    """A sentence-transformers CrossEncoder loaded from a local path (no hub access at run time)."""

    def __init__(self, path: str):
        self.path = path

    @cached_property
    def _model(self):
        from sentence_transformers import CrossEncoder

        return CrossEncoder(self.path, device="cpu")

    def rerank(self, query: str, hits: list[Hit]) -> list[Hit]:
        if not hits:
            return hits
        scores = self._model.predict([(query, h.content) for h in hits])
        order = np.argsort(-np.asarray(scores), kind="stable")
        return [_rescored(hits[i], float(scores[i])) for i in order]


class LLMReranker:
    """Listwise reranking through an OpenAI-compatible chat endpoint: the model returns the passage numbers in
    order of relevance. Passages it omits keep their fused order after the ones it ranked."""

    PROMPT = ("Rank the passages by how well they answer the query. Reply with a JSON list of passage numbers, "
              "most relevant first, and nothing else.\n\nQuery: {query}\n\n{passages}")

    def __init__(self, settings: Settings, model: str):
        self.model = model
        self.client = openai_client(settings, needed_by="KB_RERANK=llm")

    def rerank(self, query: str, hits: list[Hit]) -> list[Hit]:
        if not hits:
            return hits
        passages = "\n\n".join(f"[{i}] {h.content[:1500]}" for i, h in enumerate(hits, 1))
        reply = complete(self.client, self.model, self.PROMPT.format(query=query, passages=passages))
        match = re.search(r"\[[\d,\s]*\]", reply)
        ranked = [n - 1 for n in json.loads(match.group(0)) if 1 <= n <= len(hits)] if match else []
        order = list(dict.fromkeys(ranked)) + [i for i in range(len(hits)) if i not in ranked]
        return [_rescored(hits[i], 1.0 / (1 + position)) for position, i in enumerate(order)]


def _rescored(hit: Hit, score: float) -> Hit:
    hit.score = score
    return hit


def make_reranker(settings: Settings) -> Reranker | None:
    if settings.rerank == "cross-encoder":
        return CrossEncoderReranker(settings.rerank_model)
    if settings.rerank == "llm":
        return LLMReranker(settings, settings.rerank_model)
    return None


def mmr(conn: psycopg.Connection, model_key: str, query_vector: np.ndarray, hits: list[Hit], k: int,
        diversity: float = 0.3) -> list[Hit]:
    """Maximal Marginal Relevance over the candidates: trade relevance for novelty (diversity 0 = off)."""
    if not hits:
        return hits
    rows = conn.execute(sql.SQL("SELECT c.chunk_id, v.embedding FROM chunks c JOIN {} v USING (text_hash)"
                                " WHERE c.chunk_id = ANY(%s)").format(vector_table(conn, model_key)),
                        ([h.chunk_id for h in hits],)).fetchall()
    vectors = {chunk_id: np.asarray(v.to_numpy(), dtype=np.float32) for chunk_id, v in rows}
    for hit in hits:  # a lexical hit whose text has no vector: no similarity to anything
        vectors.setdefault(hit.chunk_id, np.zeros_like(query_vector))
    remaining, chosen = list(hits), []
    while remaining and len(chosen) < k:
        def value(hit: Hit) -> float:
            relevance = float(np.dot(vectors[hit.chunk_id], query_vector))
            redundancy = max((float(np.dot(vectors[hit.chunk_id], vectors[c.chunk_id])) for c in chosen), default=0.0)
            return (1 - diversity) * relevance - diversity * redundancy
        best = max(remaining, key=value)
        chosen.append(best)
        remaining.remove(best)
    return chosen


def freshness_boost(hits: list[Hit], weight: float, half_life_days: float = 180.0, today: date | None = None) -> list[Hit]:
    """Multiply each score by 1 + weight * 2^(-age / half-life); undated documents get no boost."""
    today = today or date.today()
    for hit in hits:
        if hit.doc_date is not None:
            age = max((today - hit.doc_date).days, 0)
            hit.score *= 1 + weight * math.pow(2, -age / half_life_days)
    return sorted(hits, key=lambda h: h.score, reverse=True)
