"""Optional post-fusion stages: cross-encoder and listwise LLM rerankers, MMR diversity, freshness boost."""

import dataclasses
from datetime import date

import numpy as np
import pytest
from fake_openai import FakeOpenAI, openai_settings

from pipelines.ingest.run import ingest
from pipelines.models.tokens import local_model_dir
from pipelines.retrieval.rerank import CrossEncoderReranker, LLMReranker, freshness_boost, mmr
from pipelines.retrieval.search import search
from pipelines.settings import SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare


@pytest.fixture
def kb(conn, embedder):
    add_source(conn, declare("samples", SAMPLES_DIR / "docs"), "tests")
    ingest(conn, embedder, load_settings())
    return conn


def test_llm_reranker_follows_the_models_order_and_keeps_the_rest(kb, embedder, settings):
    hits = search(kb, embedder, "servo drive fault codes", 5)
    before = [h.chunk_id for h in hits]
    with FakeOpenAI(chat_reply="Ranking: [3, 1]") as fake:
        reranked = LLMReranker(openai_settings(settings, fake), "fake-chat").rerank("servo drive fault codes", hits)
    assert [h.chunk_id for h in reranked] == [before[2], before[0], before[1], before[3], before[4]]
    assert "Query: servo drive fault codes" in fake.prompts[0] and "[5]" in fake.prompts[0]


def test_the_llm_reranker_of_a_new_configuration_asks_with_its_own_key(kb, embedder, settings, monkeypatch):
    """Rerankers are cached per process: one built for the old key must not serve a configuration with the new."""
    from pipelines.retrieval import responses as service

    monkeypatch.setattr(service, "_rerankers", {})
    hits = search(kb, embedder, "servo drive fault codes", 3)
    with FakeOpenAI(chat_reply="[1]") as fake:
        for key in ("old-key", "new-key"):
            configured = dataclasses.replace(openai_settings(settings, fake), rerank="llm", rerank_model="fake-chat",
                                             openai_api_key=key)
            service._reranker(configured).rerank("servo drive fault codes", hits)
    assert fake.keys == ["old-key", "new-key"]


def test_cross_encoder_reranker_orders_by_the_models_scores(kb, embedder, tmp_path):
    import torch
    from sentence_transformers import CrossEncoder

    torch.manual_seed(0)
    model_dir = tmp_path / "cross-encoder"
    CrossEncoder(str(local_model_dir()), num_labels=1, device="cpu").save(str(model_dir))
    hits = search(kb, embedder, "parental leave", 6)
    reranked = CrossEncoderReranker(str(model_dir)).rerank("parental leave", hits)
    scores = CrossEncoder(str(model_dir), device="cpu").predict([("parental leave", h.content) for h in reranked])
    assert list(scores) == sorted(scores, reverse=True)
    assert sorted(h.chunk_id for h in reranked) == sorted(h.chunk_id for h in hits)


def test_mmr_drops_near_duplicates(kb, embedder):
    hits = search(kb, embedder, "primary and secondary caregiver leave", 10, arm="dense")
    query_vector = embedder.embed(["primary and secondary caregiver leave"])[0]
    plain = mmr(kb, embedder.model_key, query_vector, list(hits), 3, diversity=0.0)
    diverse = mmr(kb, embedder.model_key, query_vector, list(hits), 3, diversity=0.9)
    assert [h.chunk_id for h in plain] == [h.chunk_id for h in hits[:3]]
    assert len({h.document for h in diverse}) > len({h.document for h in plain})


def test_freshness_boost_prefers_recent_documents(kb, embedder):
    hits = search(kb, embedder, "policy", 8)
    dated = [h for h in hits if h.doc_date]
    boosted = freshness_boost(list(hits), weight=5.0, today=date(2024, 12, 31))
    newest = max(dated, key=lambda h: h.doc_date)
    assert boosted[0].doc_date == newest.doc_date
    assert np.isclose(freshness_boost(list(hits), weight=0.0)[0].score, max(h.score for h in hits))


def test_search_with_diversity_embeds_the_query_once(kb, embedder, settings, monkeypatch):
    from pipelines.retrieval import responses as service

    calls = []

    class Counting:
        model_key, dimensions, counter = embedder.model_key, embedder.dimensions, embedder.counter

        def embed(self, texts):
            calls.append(texts)
            return embedder.embed(texts)

    monkeypatch.setitem(service._embedders, service.embedder_key(embedder.model_key, settings), Counting())
    response = service.run_search(kb, settings, "primary and secondary caregiver leave", 3, diversity=0.5)
    assert len(response["chunks"]) == 3 and calls == [["primary and secondary caregiver leave"]]
