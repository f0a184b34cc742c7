"""`kb eval`: a BEIR-format dataset through the real pipeline and the real search, scored with trec_eval.

Metrics come from pytrec_eval (the trec_eval reference implementation): hit@k is trec_eval's success@k, MRR@10 is
recip_rank over the top 10, plus nDCG@10 and recall@100. A document's rank is its best chunk's rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pipelines.embedders import Embedder
from pipelines.search import Filters, lexical_weight_for, search

METRICS = ("hit@1", "hit@5", "hit@10", "mrr@10", "ndcg@10", "recall@100")
CHUNKS_PER_QUERY = 300  # enough chunks to rank 100 distinct documents


@dataclass(frozen=True)
class Configuration:
    name: str
    arm: str
    lexical_weight: float | None = None
    rerank: bool = False


CONFIGURATIONS = (
    Configuration("dense", "dense"),
    Configuration("lexical", "lexical"),
    Configuration("hybrid", "hybrid"),
)


def load_queries(dataset: Path, split: str) -> tuple[dict[str, str], dict[str, dict[str, int]]]:
    """Queries that have judgements in the split, and the judgements {query_id: {doc_id: relevance}}."""
    qrels: dict[str, dict[str, int]] = {}
    with open(dataset / "qrels" / f"{split}.tsv", encoding="utf-8") as handle:
        for line in handle:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 3 or parts[0] == "query-id":
                continue
            qrels.setdefault(parts[0], {})[parts[1]] = int(parts[2])
    queries = {}
    with open(dataset / "queries.jsonl", encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if str(record["_id"]) in qrels:
                queries[str(record["_id"])] = record["text"]
    return queries, {q: rels for q, rels in qrels.items() if q in queries}


def document_run(hits, limit: int = 100) -> dict[str, float]:
    """Chunk hits -> documents ranked by their best chunk, as trec_eval scores (higher is better)."""
    ranked: dict[str, float] = {}
    for hit in hits:
        if hit.document not in ranked:
            ranked[hit.document] = float(limit - len(ranked))
            if len(ranked) == limit:
                break
    return ranked


def score(run: dict[str, dict[str, float]], qrels: dict[str, dict[str, int]]) -> tuple[dict[str, float], dict[str, dict]]:
    import pytrec_eval

    full = pytrec_eval.RelevanceEvaluator(qrels, {"success.1,5,10", "ndcg_cut.10", "recall.100"}).evaluate(run)
    top10 = {q: dict(sorted(docs.items(), key=lambda kv: -kv[1])[:10]) for q, docs in run.items()}
    mrr = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    per_query = {q: {"hit@1": m["success_1"], "hit@5": m["success_5"], "hit@10": m["success_10"],
                     "mrr@10": mrr[q]["recip_rank"], "ndcg@10": m["ndcg_cut_10"], "recall@100": m["recall_100"]}
                 for q, m in full.items()}
    means = {metric: round(sum(v[metric] for v in per_query.values()) / max(len(per_query), 1), 4) for metric in METRICS}
    return means, per_query


def evaluate(conn: psycopg.Connection, embedder: Embedder, queries: dict[str, str], qrels: dict[str, dict[str, int]],
             source_id: str, configurations=CONFIGURATIONS, misses: bool = False, reranker=None,
             k_overfetch: int = 20) -> dict:
    """Run every query through each configuration; returns metrics per configuration (and misses if asked)."""
    vectors = dict(zip(queries, embedder.embed(list(queries.values()))))
    cached = _CachedQueries(embedder, {text: vectors[q] for q, text in queries.items()})
    report = {}
    for config in configurations:
        run = {}
        for qid, text in queries.items():
            hits = search(conn, cached, text, CHUNKS_PER_QUERY, arm=config.arm, lexical_weight=config.lexical_weight,
                          k_overfetch=CHUNKS_PER_QUERY, filters=Filters(source_id=source_id))
            if config.rerank:  # the reranker sees the over-fetched head, as in serving
                hits = reranker.rerank(text, hits[:k_overfetch]) + hits[k_overfetch:]
            run[qid] = document_run(hits)
        means, per_query = score(run, qrels)
        entry = {"metrics": means, "queries": len(queries)}
        if misses:
            entry["misses"] = [{"query_id": q, "query": queries[q], "relevant": sorted(qrels[q]),
                                "top5": list(run[q])[:5]} for q, m in per_query.items() if not m["hit@10"]]
        report[config.name] = entry
    return report


class _CachedQueries:
    """The evaluation embeds all queries in one batch up front; search then reads them from here."""

    def __init__(self, embedder: Embedder, vectors: dict):
        self.model_key, self.dimensions, self.counter = embedder.model_key, embedder.dimensions, embedder.counter
        self._vectors = vectors

    def embed(self, texts):
        import numpy as np

        return np.stack([self._vectors[t] for t in texts])


def classifier_weights(queries: dict[str, str]) -> dict[float, int]:
    """How the query classifier splits a query set, for the report."""
    counts: dict[float, int] = {}
    for text in queries.values():
        weight = lexical_weight_for(text)
        counts[weight] = counts.get(weight, 0) + 1
    return counts
