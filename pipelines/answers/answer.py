"""Grounded answers (issue 12): retrieval (any mode, filters, groups) -> optional rerank -> numbered contexts ->
an answer in which every sentence cites its sources as [document, section], each citation checked against its
chunk before the answer is returned, and an honest "not found in the documents" with the closest sources.

With KB_CHAT_MODEL set, a chat model writes the answer from the contexts and cites them by number. Without one,
kb answers extractively: the context sentences closest in meaning to the question. Either way a sentence whose
citation is INVALID, or that cites nothing, is removed (and listed); an answer with no verified sentence left is
refused. kb abstains when the best context is too far from the question in meaning (ABSTAIN_SIMILARITY,
calibrated on samples/answers.jsonl: bench/README.md) and holds no code the question asks about, or when the
model says the answer is not there.

Query-side options, both off by default: HyDE (search with the embedding of a hypothetical answer the chat model
writes) and contextual compression (keep only the sentences of each context that bear on the question).
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass

import numpy as np
import psycopg

from pipelines.answers.citations import validate_citations
from pipelines.ingest.sentences import split_sentences
from pipelines.models.chat import ChatNotConfigured, complete, openai_client
from pipelines.retrieval.search import Filters, embed_query, visible_sources
from pipelines.settings import Settings

NOT_FOUND = "not found in the documents"
NOT_FOUND_MARK = "NOT_FOUND"
# Abstain when the best context's cosine to the question is below this (and no context holds a code the question
# asks about). Calibrated on samples/answers.jsonl with the default int8 model, where answerable questions' best
# contexts score 0.39-0.89 and unanswerable ones 0.19-0.68: 0.55 abstains on 8 of 12 unanswerable questions and on
# 2 of 20 answerable ones (the sweep is in bench/README.md, "Answers"). The chat model's own "not found" catches
# the unanswerable questions that retrieval cannot tell apart.
ABSTAIN_SIMILARITY = 0.55
COMPRESS_SIMILARITY = 0.3  # compression keeps context sentences at least this close to the question (and the best)
EXTRACT_MAX_SENTENCES = 2
PROMPT = ("Answer the question using only the numbered contexts below. After every sentence, cite the contexts it "
          "relies on as [1], [2] and so on. Do not add anything the contexts do not say. If the contexts do not "
          f"contain the answer, reply exactly {NOT_FOUND_MARK}.\n\nQuestion: {{question}}\n\nContexts:\n{{contexts}}")
HYDE_PROMPT = "Write a short passage, two or three sentences, that answers this question: {question}"
CITATION = re.compile(r"\s*\[(\d+(?:\s*,\s*\d+)*)\]")
AFTER_THE_STOP = re.compile(r"([.!?])((?:\s*\[\d+(?:\s*,\s*\d+)*\])+)")  # "pay. [1]": the marks belong before it


@dataclass
class Context:
    n: int
    chunk_id: int  # what a citation points at: the chunk itself, or a card's source chunk
    document: str  # source:locator
    section: str
    text: str
    similarity: float | None  # the hit's cosine to the query
    via_card: str | None = None  # the card's question, when a card found this context

    def label(self) -> str:
        return f"[{self.document}, {self.section}]" if self.section else f"[{self.document}]"


def answer_question(conn: psycopg.Connection, settings: Settings, question: str, k: int = 5, *, mode: str = "qa_first",
                    filters: Filters | None = None, rerank: bool = True, hyde: bool = False,
                    compress: bool = False) -> dict:
    from pipelines.retrieval.responses import query_embedder, retrieve

    timings: dict[str, float] = {}
    started = time.perf_counter()
    filters = filters or Filters()
    embedder = query_embedder(conn, settings)
    client = openai_client(settings) if settings.chat_model else None
    question_vector = embed_query(embedder, question)  # once: retrieval, compression and extraction score with it
    vector = question_vector
    if hyde:
        if client is None:
            raise ChatNotConfigured("HyDE needs a chat model: set KB_CHAT_MODEL")
        vector = embed_query(embedder, complete(client, settings.chat_model, HYDE_PROMPT.format(question=question)))
    query_class, hits = retrieve(conn, settings, question, k, mode=mode, filters=filters, rerank=rerank, vector=vector)
    timings["retrieve_s"] = round(time.perf_counter() - started, 3)
    contexts = _contexts(conn, hits)
    if compress:
        contexts = _compressed(embedder, question_vector, contexts)
    confidence = max((c.similarity for c in contexts if c.similarity is not None), default=0.0)
    exact = any(hit.exact for hit in hits)  # a context holds the code the question asks about: lexical evidence
    result = {"question": question, "mode": mode, "generator": f"chat:{settings.chat_model}" if client else "extractive",
              "confidence": round(confidence, 4), "exact_match": exact, "contexts": [asdict(c) for c in contexts],
              "timings": timings}
    if confidence < ABSTAIN_SIMILARITY and not exact:
        return _abstain(result, contexts, f"the closest context's similarity to the question, {confidence:.2f}, is below"
                                          f" {ABSTAIN_SIMILARITY}")
    started = time.perf_counter()
    if client is not None:
        reply = complete(client, settings.chat_model, PROMPT.format(
            question=question, contexts="\n".join(f"[{c.n}] {c.label()} {c.text}" for c in contexts)))
        if NOT_FOUND_MARK in reply:
            timings["generate_s"] = round(time.perf_counter() - started, 3)
            return _abstain(result, contexts, "the model found no answer in the contexts")
        sentences = _cited_sentences(reply, contexts)
    else:
        sentences = _extract(embedder, question_vector, contexts)
    timings["generate_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    kept, removed = _verified(conn, embedder, sentences, contexts, filters)
    timings["verify_s"] = round(time.perf_counter() - started, 3)
    result["removed"] = removed
    if not kept:
        return _abstain(result, contexts, "no sentence of the answer could be verified against the sources it cites")
    by_id = {c.chunk_id: c for c in contexts}
    for sentence in kept:  # the only labels an answer shows are the ones kb writes from its metadata
        sentence["text"] = without_labels(sentence["text"])
    result.update(abstained=False, reason=None, sentences=kept,
                  answer=" ".join(s["text"] + " " + " ".join(dict.fromkeys(by_id[x["chunk_id"]].label()
                                                                            for x in s["citations"]))
                                  for s in kept))
    return result


# A source label as kb writes it, `[source:document, section]` or `[document.ext, section]`: text that looks like one
# inside a document or a model's reply is not kb's, and would cite what nobody checked.
_LABEL = re.compile(r"\s*\[(?:[\w.-]+:[^\]\n]*|[^\]\n,]+\.[A-Za-z0-9]{1,5}(?:,[^\]\n]*)?)\]")


def without_labels(text: str) -> str:
    return " ".join(_LABEL.sub("", text).split())


def _abstain(result: dict, contexts: list[Context], reason: str) -> dict:
    result.update(abstained=True, reason=reason, answer=f"The answer was {NOT_FOUND}.", sentences=[],
                  closest_sources=[{"document": c.document, "section": c.section, "chunk_id": c.chunk_id,
                                    "similarity": c.similarity} for c in contexts[:3]])
    result.setdefault("removed", [])
    return result


def _contexts(conn: psycopg.Connection, hits: list) -> list[Context]:
    """Numbered contexts, one per citable chunk: a card stands for its source chunk, whose text is the context."""
    sources = {r[0]: r[1] for r in conn.execute("SELECT chunk_id, text FROM chunks WHERE chunk_id = ANY(%s)",
                                                ([h.source_chunk_id for h in hits if h.source_chunk_id],)).fetchall()}
    contexts: dict[int, Context] = {}
    for hit in hits:
        chunk_id = hit.source_chunk_id or hit.chunk_id
        if chunk_id not in contexts:
            text = sources.get(chunk_id, hit.content)
            contexts[chunk_id] = Context(len(contexts) + 1, chunk_id, f"{hit.source}:{hit.document}",
                                         " > ".join(hit.section_path), text, hit.dense_score,
                                         hit.question if hit.source_chunk_id else None)
    return list(contexts.values())


def _compressed(embedder, question_vector: np.ndarray, contexts: list[Context]) -> list[Context]:
    if not contexts:
        return contexts
    split = [split_sentences(context.text) or [context.text] for context in contexts]
    all_scores = embedder.embed([s for sentences in split for s in sentences]) @ question_vector  # one call
    ends = np.cumsum([len(sentences) for sentences in split])
    for context, sentences, end in zip(contexts, split, ends):
        scores = all_scores[end - len(sentences):end]
        best = float(scores.max())
        context.text = " ".join(s for s, score in zip(sentences, scores) if score >= COMPRESS_SIMILARITY or score == best)
    return contexts


def _extract(embedder, question_vector: np.ndarray, contexts: list[Context]) -> list[tuple[str, list[int]]]:
    """The sentence closest to the question among the top contexts, and the next one of the same context when it
    is nearly as close."""
    candidates = [(s, c.n) for c in contexts[:3] for s in (split_sentences(c.text) or [c.text])]
    scores = embedder.embed([s for s, _ in candidates]) @ question_vector
    order = np.argsort(-scores)
    best = candidates[order[0]]
    chosen = [best] + [candidates[i] for i in order[1:EXTRACT_MAX_SENTENCES]
                       if candidates[i][1] == best[1] and scores[i] >= scores[order[0]] - 0.05]
    return [(text, [n]) for text, n in chosen]


def _cited_sentences(reply: str, contexts: list[Context]) -> list[tuple[str, list[int]]]:
    """(sentence without its citation marks, context numbers it cites) for each sentence of the model's reply."""
    sentences = []
    for sentence in split_sentences(AFTER_THE_STOP.sub(r"\2\1", reply)):
        numbers = [int(n) for group in CITATION.findall(sentence) for n in group.split(",")]
        text = CITATION.sub("", sentence).strip()
        if text:
            sentences.append((text, numbers))
    return sentences


def _verified(conn: psycopg.Connection, embedder, sentences: list[tuple[str, list[int]]], contexts: list[Context],
              filters: Filters) -> tuple[list[dict], list[dict]]:
    """Each sentence's citations checked against their chunks (pipelines/answers/citations.py). Kept: every citation VALID
    or WEAK. Removed: a sentence citing nothing, a context number that does not exist, or an INVALID chunk."""
    by_number = {c.n: c for c in contexts}
    readable = list(visible_sources(conn, filters.groups, filters.source_id))
    claims, removed = [], []
    for text, numbers in sentences:
        unknown = [n for n in numbers if n not in by_number]
        if not numbers or unknown:
            removed.append({"text": text, "why": "cites no context" if not numbers else f"cites missing context {unknown}"})
        else:
            claims.append({"text": text, "citations": [by_number[n].chunk_id for n in dict.fromkeys(numbers)]})
    verdicts = validate_citations(conn, embedder, claims, [c.chunk_id for c in contexts], readable,
                                  as_of=filters.as_of) if claims else []
    kept, at = [], 0
    for claim in claims:
        checks = verdicts[at:at + len(claim["citations"])]
        at += len(claim["citations"])
        citations = [{"chunk_id": v.chunk_id, "status": v.status, "similarity": v.similarity, "reason": v.reason}
                     for v in checks]
        if any(v.status == "INVALID" for v in checks):
            removed.append({"text": claim["text"], "why": "an INVALID citation", "citations": citations})
        else:
            kept.append({"text": claim["text"], "citations": citations})
    return kept, removed
