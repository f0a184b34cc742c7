"""Q&A cards: short question -> answer pairs distilled from the published chunks (issue 12).

For a direct question ("what is the EC50 of AVX-006?") a card matches more strongly and more cleanly than the
paragraph it came from. Cards are chunks of kind 'card' (sql/009_qa_cards.sql): they are versioned, access-
filtered, searched and embedded like any chunk, carry their source chunk for citations, and close when it closes.

Two generators:
- FAQ rules, always on, offline and deterministic: a section heading phrased as a question (its first chunk is
  the answer; a heading that is not a question, "How to request leave", makes no card), "Q: ... A: ..." pairs in
  a chunk's text (on two lines, or one paragraph as Markdown FAQs reach kb), and JSONL records with `question`
  and `answer` fields.
- A chat model, when KB_CHAT_MODEL is set: any OpenAI-compatible endpoint writes up to three cards per chunk.
Generation is cached by (generator, the chunk's text hash): a refresh asks only about new text, a restored
document gets its cards back without a call, and a new model or prompt version is a new generator, whose cards
replace the old ones chunk by chunk as its backfill goes.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import psycopg
from psycopg.types.json import Jsonb

from pipelines.ingest.enrich import ENRICH_VERSION, context_title, embed_prefix, extract_entities
from pipelines.ingest.hashing import hash_text
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.models.chat import complete, openai_client
from pipelines.models.tokens import TokenCounter
from pipelines.settings import Settings
from pipelines.storage import bulk

FAQ_GENERATOR = "faq-rules-2"  # 2: Markdown Q/A lines, headings must be questions (issue 19)
PROMPT_VERSION = "cards-1"
CARD_KIND = "card"
MAX_CARDS_PER_CHUNK = 3
# A heading is a question when it ends with "?" or reads as one: an interrogative and then an auxiliary ("How do I
# reset my token"), or an auxiliary and then its subject ("Can I swap my week"). "How to request leave" and
# "What we offer" are headings, not questions: a card needs a question.
QUESTION_FORM = re.compile(r"^\s*(?:(?:how|why|what|when|which|who|whom|whose|where)\s+(?:do|does|did|is|are|was|were|"
                           r"can|could|should|shall|will|would|may|might|must|has|have|had)|(?:can|could|should|shall|"
                           r"does|do|did|is|are|was|were|will|would|may|must|has|have)\s+(?:i|we|you|they|he|she|it|"
                           r"my|our|your|their|the|a|an|this|that|there))\b", re.I)
# "Q: ... A: ..." pairs, the usual FAQ layout: on separate lines, or on one line when the question ends with "?"
# (a Markdown FAQ's Q and A lines reach kb as one paragraph). A pair ends where the next Q: begins.
_NEXT_Q = r"(?:^|\n|(?<=[.!?])[ \t])\s*(?:\*\*)?(?:Q|Question)\s*[:.)]"
QA_PAIR = re.compile(rf"(?:^|\n|(?<=[.!?])[ \t])\s*(?:\*\*)?(?:Q|Question)\s*[:.)]\s*(?:\*\*)?\s*(?P<q>[^\n]+?\?|.+?)"
                     r"(?:\s*\n\s*|(?<=\?)[ \t]+)(?:\*\*)?(?:A|Answer)\s*[:.)]\s*(?:\*\*)?\s*(?P<a>.+?)"
                     rf"(?=\s*{_NEXT_Q}|\s*\Z)", re.S | re.I)
PROMPT = ("Write up to {n} questions that the passage below answers directly, each with its answer taken from the "
          "passage (a short quote or a close paraphrase, nothing the passage does not say). Reply with a JSON list of "
          '{{"question": ..., "answer": ...}} objects and nothing else; reply [] if the passage answers no question.'
          "\n\nPassage:\n{passage}")


@dataclass(frozen=True)
class SourceChunk:
    chunk_id: int
    document_id: int
    text_hash: str
    text: str
    embed_text: str
    section_path: list[str]
    page_number: int | None
    title: str | None
    metadata: dict
    first_in_section: bool
    first_in_document: bool


def faq_cards(chunk: SourceChunk) -> list[dict]:
    """Cards the FAQ rules find in a chunk (deterministic, no model)."""
    cards = []
    question, answer = chunk.metadata.get("question"), chunk.metadata.get("answer")
    if chunk.first_in_document and isinstance(question, str) and isinstance(answer, str) and question.strip():
        cards.append({"question": question.strip(), "answer": answer.strip()})
    heading = chunk.section_path[-1] if chunk.section_path else ""
    if chunk.first_in_section and _is_question(heading):
        cards.append({"question": heading.strip(), "answer": chunk.text.strip()})
    for pair in QA_PAIR.finditer(chunk.text):
        cards.append({"question": " ".join(pair["q"].split()), "answer": " ".join(pair["a"].split())})
    return _distinct(cards)


def _is_question(text: str) -> bool:
    text = text.strip()
    return bool(text) and (text.endswith("?") or QUESTION_FORM.match(text) is not None)


def _distinct(cards: list[dict]) -> list[dict]:
    seen, out = set(), []
    for card in cards:
        key = card["question"].lower()
        if card["answer"] and key not in seen:
            seen.add(key)
            out.append(card)
    return out[:MAX_CARDS_PER_CHUNK]


class ChatCards:
    """Cards written by a chat model through any OpenAI-compatible endpoint: one request per chunk, a bounded
    pool of them at a time; the openai client retries 408/409/429/5xx and timeouts with backoff."""

    def __init__(self, settings: Settings):
        self.model = settings.chat_model
        self.generator, self.family = f"chat:{settings.chat_model}:{PROMPT_VERSION}", "chat"
        self.batch_size = 64  # chunks per transaction: what a killed run asks the model again, at most
        self.concurrency = settings.chat_concurrency
        self.client = openai_client(settings)

    def cards(self, chunks: list[SourceChunk]) -> list[list[dict]]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return list(pool.map(self._one, chunks))

    def _one(self, chunk: SourceChunk) -> list[dict]:
        return parse_cards(complete(self.client, self.model, PROMPT.format(n=MAX_CARDS_PER_CHUNK, passage=chunk.embed_text)))


def parse_cards(reply: str) -> list[dict]:
    """The JSON list in a model's reply; anything malformed yields no card rather than a failed run."""
    match = re.search(r"\[.*\]", reply, re.S)
    try:
        items = json.loads(match.group(0)) if match else []
    except ValueError:
        return []
    cards = [{"question": str(i.get("question", "")).strip(), "answer": str(i.get("answer", "")).strip()}
             for i in items if isinstance(i, dict)]
    return _distinct([c for c in cards if c["question"]])


class FaqCards:
    generator, family = FAQ_GENERATOR, "faq"
    batch_size = 2000  # rules cost nothing to redo: large transactions, few round trips (as the enrich stage)

    def cards(self, chunks: list[SourceChunk]) -> list[list[dict]]:
        return [faq_cards(chunk) for chunk in chunks]


def generators(settings: Settings) -> list:
    return [FaqCards()] + ([ChatCards(settings)] if settings.chat_model else [])


# Live chunks (not cards) of the sources that have no card from this generator yet, after a chunk id: the stage
# pages through them by key, so each batch reads its own rows and a first ingest stays linear in the chunks (a
# window over every live chunk of the source, computed again for each batch, made it quadratic).
PENDING_IDS = """
SELECT c.chunk_id
FROM chunks c JOIN documents d USING (document_id)
WHERE c.valid_to IS NULL AND c.kind <> 'card' AND c.chunk_id > %(after)s
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
  AND NOT EXISTS (SELECT 1 FROM card_rounds r WHERE r.chunk_id = c.chunk_id AND r.generator = %(generator)s)
"""
# A batch of them with what a generator needs, whether each opens its section or its document included.
PENDING = f"""
WITH batch AS ({PENDING_IDS} ORDER BY c.chunk_id LIMIT %(limit)s)
SELECT c.chunk_id, c.document_id, c.text_hash, c.text, c.embed_text, c.section_path, c.page_number, d.title,
       d.metadata,
       NOT EXISTS (SELECT 1 FROM chunks o WHERE o.document_id = c.document_id AND o.valid_to IS NULL
                   AND o.kind <> 'card' AND o.ordinal < c.ordinal
                   AND o.section_path IS NOT DISTINCT FROM c.section_path) AS first_in_section,
       NOT EXISTS (SELECT 1 FROM chunks o WHERE o.document_id = c.document_id AND o.valid_to IS NULL
                   AND o.kind <> 'card' AND o.ordinal < c.ordinal) AS first_in_document
FROM batch JOIN chunks c USING (chunk_id) JOIN documents d USING (document_id)
ORDER BY c.chunk_id
"""

CARD_COLUMNS = ("document_id", "ordinal", "kind", "text", "embed_prefix", "text_hash", "section_path", "page_number",
                "token_count", "entities", "chunker_version", "enrich_version", "source_chunk_id", "question",
                "generator")


def card_rows(chunk: SourceChunk, cards: list[dict], generator: str, counter: TokenCounter) -> list[tuple]:
    """A card's embedded text is the document title and section, then the question and its answer; the answer is
    cut (between tokens) when the whole would not fit the model."""
    if not cards:  # most chunks make none: their title is not tokenized for nothing
        return []
    prefix = embed_prefix(context_title(counter, chunk.title), chunk.section_path)
    rows = []
    for n, card in enumerate(cards):
        head = f"{prefix}Q: {card['question']}\nA: "
        answer = _fit(counter, head, card["answer"])
        embedded = head + answer
        rows.append((chunk.document_id, -1 - n, CARD_KIND, answer, head, hash_text(embedded), chunk.section_path,
                     chunk.page_number, counter.count([embedded])[0], Jsonb(extract_entities(embedded)), generator,
                     ENRICH_VERSION, chunk.chunk_id, card["question"], generator))
    return rows


def _fit(counter: TokenCounter, head: str, answer: str) -> str:
    budget = counter.max_tokens - counter.count([head])[0] - 2
    if counter.count([head + answer])[0] <= counter.max_tokens:
        return answer
    ends = counter.token_ends(answer)
    return answer[:ends[max(budget, 1) - 1]].rstrip() if ends else answer


def generate_cards(conn: psycopg.Connection, settings: Settings, embedders: list, source_ids: list[str] | None = None,
                   progress: Progress = NO_PROGRESS) -> StageReport:
    """Cards for every live chunk of these sources that a generator has not looked at yet: from the cache when this
    generator saw the same text before, else from the generator; embedded in every model that serves or is being
    built, then inserted live in one transaction per batch, replacing the chunk's cards from an older version of
    the same generator (a new model or prompt)."""
    from pipelines.ingest.embed import ensure_vectors

    report = StageReport("cards", ("chunks", "cards", "generated", "reused", "refused"))
    counter = embedders[0].counter
    chosen = generators(settings)
    progress.total(sum(conn.execute(f"SELECT count(*) FROM ({PENDING_IDS}) p", {"ids": source_ids, "after": 0,
                                                                               "generator": g.generator}).fetchone()[0]
                       for g in chosen))
    for generator in chosen:
        after = 0
        while rows := conn.execute(PENDING, {"ids": source_ids, "generator": generator.generator, "after": after,
                                             "limit": generator.batch_size}).fetchall():
            chunks = [SourceChunk(*row) for row in rows]
            after = chunks[-1].chunk_id
            cached = dict(conn.execute("SELECT text_hash, cards FROM card_cache WHERE generator = %s AND text_hash = ANY(%s)",
                                       (generator.generator, [c.text_hash for c in chunks])).fetchall())
            # one per text: the same text in two documents (a PDF and its DOCX) is asked and cached once
            todo = list({c.text_hash: c for c in chunks if c.text_hash not in cached}.values())
            if todo:
                for chunk, made in zip(todo, generator.cards(todo)):
                    cached[chunk.text_hash] = made
                with conn.transaction():  # kept even if a later step fails: the model is never asked twice
                    bulk.copy_rows(conn, "card_cache", ("generator", "text_hash", "cards"),
                                   ((generator.generator, c.text_hash, Jsonb(cached[c.text_hash])) for c in todo))
            cards = [row for c in chunks for row in card_rows(c, cached[c.text_hash], generator.generator, counter)]
            refused = set()
            for embedder in embedders:
                refused |= ensure_vectors(conn, embedder, {row[5]: row[4] + row[3] for row in cards})  # prefix + answer
            cards = [row for row in cards if row[5] not in refused]
            with conn.transaction():
                ids = [c.chunk_id for c in chunks]
                conn.execute("UPDATE chunks SET valid_to = now() WHERE source_chunk_id = ANY(%s) AND valid_to IS NULL"
                             " AND generator <> %s AND starts_with(generator, %s)", (ids, generator.generator, generator.family))
                bulk.copy_rows(conn, "chunks", CARD_COLUMNS, cards)
                bulk.copy_rows(conn, "card_rounds", ("chunk_id", "generator"), ((i, generator.generator) for i in ids))
            report.counts["chunks"] += len(chunks)
            report.counts["cards"] += len(cards)
            report.counts["generated"] += len(todo)
            report.counts["reused"] += len(chunks) - len(todo)
            report.counts["refused"] += len(refused)
            progress.advance(len(chunks))
    return report.finish()
