"""The search response, one shape for the CLI and the HTTP API."""

from __future__ import annotations

import psycopg
from psycopg import sql

from pipelines.models.chat import client_identity
from pipelines.models.embedders import Embedder, embedder_for
from pipelines.retrieval.readable import DOCUMENTS, readable
from pipelines.retrieval.search import (
    RRF_K,
    TIE_SHARE,
    Filters,
    add_highlights,
    embed_query,
    normalised_query,
    search_explained,
)
from pipelines.settings import Settings
from pipelines.storage.vectors import active_model, registered_dimensions


class EmptyKnowledgeBase(LookupError):
    pass


def _serving_model(conn: psycopg.Connection) -> str:
    model = active_model(conn)
    if model is None:
        raise EmptyKnowledgeBase("the knowledge base is empty: run `kb ingest` first")
    return model


_embedders: dict[tuple, Embedder] = {}


def embedder_key(model_key: str, settings: Settings) -> tuple:
    return model_key, *client_identity(settings)


def _query_embedder(conn: psycopg.Connection, model_key: str, settings: Settings) -> Embedder:
    """Loaded once per process, model and client identity: a server must not reload the model per request, and a
    process given another endpoint or key for the same model (a second configuration, an endpoint moved, a key
    rotated) must not keep asking with the old one. Query vectors are held to the model's registered dimension,
    whatever its endpoint answers."""
    key = embedder_key(model_key, settings)
    if key not in _embedders:
        _embedders[key] = embedder_for(model_key, settings, registered_dimensions(conn, model_key))
    return _embedders[key]


_rerankers: dict[tuple, object] = {}


def _reranker(settings: Settings):
    key = (settings.rerank, settings.rerank_model, *client_identity(settings))  # the llm reranker's client
    if key not in _rerankers:
        from pipelines.retrieval.rerank import make_reranker

        _rerankers[key] = make_reranker(settings)
    return _rerankers[key]


def serving_problem(conn: psycopg.Connection, settings: Settings) -> tuple[str | None, str | None]:
    """(the active model, why it cannot serve a query, or None when it can). The database answering is not
    enough for /health: a model whose vector table is gone, or whose queries would embed to another dimension
    than its stored vectors, fails every search."""
    row = conn.execute("SELECT model_key, dimensions, vector_table FROM embedding_models WHERE state = 'active'").fetchone()
    if row is None:
        return None, "the knowledge base is empty: run `kb ingest` first"
    model, dimensions, table = row
    stored = conn.execute("SELECT a.atttypmod FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid"
                          " WHERE c.relname = %s AND pg_table_is_visible(c.oid) AND a.attname = 'embedding'"
                          " AND NOT a.attisdropped", (table,)).fetchone()
    if stored is None:
        return model, f"the model's vector table {table} is missing"
    if stored[0] != dimensions:
        return model, f"the model is registered with {dimensions} dimensions, its vector table holds {stored[0]}"
    try:
        queries = _query_embedder(conn, model, settings).dimensions
    except Exception as exc:  # noqa: BLE001 - unknown model, unreachable endpoint: it cannot embed queries
        return model, f"cannot embed queries for the model ({type(exc).__name__})"
    if queries != dimensions:
        return model, f"queries embed to {queries} dimensions, the model is registered with {dimensions}"
    return model, None


def query_embedder(conn: psycopg.Connection, settings: Settings) -> Embedder:
    """The embedder of the model being served: queries must be embedded in the vector space search reads."""
    return _query_embedder(conn, _serving_model(conn), settings)


def retrieve(conn: psycopg.Connection, settings: Settings, query: str, k: int = 5, *, arm: str = "hybrid",
             lexical_weight: float | None = None, k_overfetch: int = 20, filters: Filters | None = None,
             mode: str = "chunks", rerank: bool = True, diversity: float = 0.0, freshness: float = 0.0,
             exact_first: bool = True, vector=None) -> tuple:
    """(query class, top-k hits) with the active model. The optional stages (reranker when configured, MMR
    diversity, freshness boost) work on the over-fetched candidates. `vector` replaces the query's own embedding
    in the dense arm (HyDE)."""
    query = normalised_query(query)  # embedded, reranked and searched as the documents were read
    model = _serving_model(conn)
    embedder = _query_embedder(conn, model, settings)
    reranker = _reranker(settings) if rerank else None
    post = reranker is not None or diversity > 0 or freshness > 0
    if vector is None and (arm != "lexical" or diversity > 0):
        vector = embed_query(embedder, query)  # embedded once, used by search and by MMR
    query_class, hits = search_explained(conn, embedder, query, max(k_overfetch, k) if post else k, arm=arm,
                                         lexical_weight=lexical_weight, k_overfetch=k_overfetch, filters=filters,
                                         model_key=model, vector=vector, exact_first=exact_first, mode=mode)
    if post:
        from pipelines.retrieval.rerank import freshness_boost, mmr

        if reranker is not None:
            hits = reranker.rerank(query, hits)
        if freshness > 0:
            hits = freshness_boost(hits, freshness)
        if diversity > 0:
            hits = mmr(conn, model, vector, hits, k, diversity)
        hits = hits[:k]
    return query_class, hits


def run_search(conn: psycopg.Connection, settings: Settings, query: str, k: int = 5, *, debug: bool = False,
               filters: Filters | None = None, mode: str = "chunks", arm: str = "hybrid", exact_first: bool = True,
               **options) -> dict:
    """The search response the CLI and the API return (see retrieve)."""
    filters = filters or Filters()
    query_class, hits = retrieve(conn, settings, query, k, filters=filters, mode=mode, arm=arm,
                                 exact_first=exact_first, **options)
    if debug:
        add_highlights(conn, hits, normalised_query(query))  # the terms and codes as they were searched
    response = {
        "query": query, "k": k, "source_id": filters.source_id, "mode": mode, "arm": arm,
        "chunks": [hit.as_dict(debug) for hit in hits],
    }
    if debug:
        response["explain"] = {**query_class.as_dict(), "exact_first": exact_first, "tie_share": TIE_SHARE,
                               "rrf_k": RRF_K}
    if not hits and filters.as_of is not None and (note := _as_of_note(conn, filters)):
        response["note"] = note
    return response


NEAR_TIE_MARK = "≈"
NEAR_TIE_LEGEND = (f"{NEAR_TIE_MARK}: ranked by the arms' own scores in a near-tie, or first for holding the"
                   " query's code, so not in the order of this fused score")


def shown_scores(scores: list[float]) -> list[str]:
    """The fused scores as shown beside results in rank order: a score that ranks against its number (above a
    higher one, or below a lower one) is marked, so no list reads 0.0161 above 0.0162 unexplained."""
    shown = []
    for i, score in enumerate(scores):
        inverted = any(score > s for s in scores[:i]) or any(score < s for s in scores[i + 1:])
        shown.append(f"{NEAR_TIE_MARK if inverted else ''}{score:.4f}")
    return shown


def _as_of_note(conn: psycopg.Connection, filters: Filters) -> str | None:
    """Why an as-of read found nothing, when the reason is the date: the caller's history starts later."""
    visible = readable(conn, filters.groups, filters.source_id, filters.as_of)
    first = conn.execute(sql.SQL("SELECT min(c.valid_from) FROM chunks c JOIN documents d USING (document_id)"
                                 " WHERE {}").format(DOCUMENTS), visible.params()).fetchone()[0]
    if first is None or filters.as_of < first:
        since = f"its history starts at {first.isoformat(timespec='seconds')}" if first else "it holds nothing yet"
        return (f"nothing was in the knowledge base at {filters.as_of.isoformat(timespec='seconds')}: {since}"
                " (kb keeps versions from its first ingest on, not the documents' own dates)")
    return None


def run_citation_check(conn: psycopg.Connection, settings: Settings, claims: list[dict], retrieved: list[int],
                       groups: list[str]) -> dict:
    from pipelines.answers.citations import validate_citations

    model = _serving_model(conn)
    results = validate_citations(conn, _query_embedder(conn, model, settings), claims, retrieved,
                                 readable(conn, groups))
    counts = {status: sum(r.status == status for r in results) for status in ("VALID", "WEAK", "INVALID")}
    return {"citations": [r.as_dict() for r in results], "summary": counts}
