"""Grounded answers (issues 12, 19): retrieval (any mode, filters, groups) -> optional rerank -> numbered contexts
-> an answer in which every sentence cites its sources as [document, section], each citation checked against its
chunk before the answer is returned, and an honest "not found in the documents" with the closest sources.

Whether to answer at all is decided before anything is written, from calibrated evidence (evidence.py): the
contexts' cosine to the question, how much of the question's rare vocabulary they hold, whether the context the
dense arm likes best holds it too, and how well their best sentence answers; a context holding every code the
question asks about, verbatim, answers.
Without a chat model kb answers extractively: a matching Q&A card answers with its answer; otherwise the best
context sentence, scored by meaning and by the question's rare words with its section heading (never a sentence
that is itself a question, and only from contexts holding the question's codes), with the short value (number,
date, name) cut from it when the question asks for one. With KB_CHAT_MODEL set, the model writes the answer and
cites contexts by number, and kb checks what it wrote: a reply that says it found nothing is a refusal whatever
its wording, a citation of a context that does not say the sentence is dropped, a sentence no cited context says
is removed, labels copied from the text are stripped. Either way a sentence whose citation is INVALID, or that
cites nothing, is removed (and listed); an answer with no verified sentence left is refused.

Query-side options, both off by default: HyDE (search with the embedding of a hypothetical answer the chat model
writes) and contextual compression (keep only the sentences of each context that bear on the question).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import psycopg
from psycopg import sql

from pipelines.answers import evidence as ev
from pipelines.answers.asked import Asked, asked
from pipelines.answers.calibration import DEFAULT, Calibration, current
from pipelines.answers.citations import validate_citations
from pipelines.answers.short_answer import asks_for_value, short_answer
from pipelines.ingest.report import NO_PROGRESS, Progress
from pipelines.ingest.sentences import split_sentences
from pipelines.models.chat import ChatNotConfigured, complete, openai_client
from pipelines.retrieval.search import Filters, cited, embed_query, normalised_query
from pipelines.settings import Settings

NOT_FOUND = "not found in the documents"
NOT_FOUND_MARK = "NOT_FOUND"
COMPRESS_SIMILARITY = 0.3  # compression keeps context sentences at least this close to the question (and the best)
EXTRACT_CONTEXTS = 5  # contexts whose sentences may answer
EXTRACT_MARGIN = 1.0  # a second sentence of the best one's context joins it within this logit (calibration: +3 points)
VALUE_CANDIDATES = 3  # a question asking for a value: the best sentences looked at for one (short_answer, ~10 ms each)
# A sentence that asks ("What is Coffin-Lowry syndrome?:", an FAQ heading, "Why does this happen?") shares the
# question's words and so scores high, yet answers nothing: the answer is another sentence.
ASKS = re.compile(r"\?[\s\"'\u201d)\]]*:?\s*$")
PROMPT = ("Answer the question using only the numbered contexts below. After every sentence, cite the contexts it "
          "relies on as [1], [2] and so on. Do not add anything the contexts do not say. If the contexts do not "
          f"contain the answer, reply exactly {NOT_FOUND_MARK}.\n\nQuestion: {{question}}\n\nContexts:\n{{contexts}}")
# A yes/no question: the verdict first, then the conditions it depends on, each sentence cited as always.
YES_NO_PROMPT = ("\n\nThe question asks yes or no: begin with Yes or No, then give the conditions it depends on and"
                 " the sentence of the contexts that decides it, citing it.")
HYDE_PROMPT = "Write a short passage, two or three sentences, that answers this question: {question}"
CITATION = re.compile(r"\[(\d+(?:\s*,\s*\d+)*)\]")
# A run of citation marks: "[1]", "[1, 2]", "[1][2]", "[1], [2] and [3]" (a model copying the prompt's "[1], [2]").
CITATIONS = re.compile(r"\s*\[\d+(?:\s*,\s*\d+)*\](?:\s*(?:,|and)?\s*\[\d+(?:\s*,\s*\d+)*\])*")
AFTER_THE_STOP = re.compile(r"([.!?])(" + CITATIONS.pattern + ")")  # "pay. [1]": the marks belong before it
# A reply that says, in any words, that the contexts do not answer: small models rarely write NOT_FOUND exactly.
DECLINES = re.compile(r"NOT[_ ]FOUND|\b(?:answer|information)\s+(?:is|was)\s+not\s+(?:found|given|provided|mentioned|"
                      r"available|stated)|\b(?:do|does|did)\s+not\s+(?:contain|mention|say|state|provide|include|"
                      r"specify)|\bno\s+(?:information|answer|mention)\b|\bcannot\s+(?:find|answer|determine)|"
                      r"\bnot\s+(?:mentioned|stated|specified)\s+in\b|\bI\s+(?:don't|do not)\s+know\b", re.I)


@dataclass
class Context:
    n: int
    chunk_id: int  # what a citation points at: the chunk itself, or a card's source chunk
    document: str  # source:locator
    section: str
    text: str
    similarity: float | None  # the hit's cosine to the query
    page: int | None = None  # the page the chunk starts on (PDFs)
    via_card: str | None = None  # the card's question, when a card found this context
    card_answer: str | None = None  # that card's answer
    title: str | None = None  # its document's title: the lexical arm reads it with the chunk (titles prepended)
    coverage: float = 0.0  # its lexical evidence: the share of the question's rare vocabulary it holds
    sentences: tuple[str, ...] = field(default=(), repr=False)  # the sentences that may answer

    def label(self) -> str:
        where = cited(self.document, self.page)
        return f"[{where}, {self.section}]" if self.section else f"[{where}]"


@dataclass
class Gathered:
    """What a question's answer is decided and written from: its contexts, their sentences ranked, the evidence."""
    contexts: list[Context]
    lexemes: dict[str, set[str]]
    held: list[int]  # the contexts the code rule answers from
    ranked: list[ev.Candidate]
    found: dict  # weigh's verdict


class _Remembering:
    """An embedder that embeds each text once (a calibration's probes meet the same sentences again and again)."""

    def __init__(self, embedder):
        self.embedder, self.model_key, self.known = embedder, embedder.model_key, {}

    def embed(self, texts: list[str]) -> np.ndarray:
        todo = list(dict.fromkeys(t for t in texts if t not in self.known))
        if todo:
            self.known.update(zip(todo, self.embedder.embed(todo)))
        return np.array([self.known[t] for t in texts])


def gather(conn: psycopg.Connection, settings: Settings, embedder, asked: Asked, k: int, *, mode: str,
           filters: Filters, rerank: bool, calibration: Calibration, message_vector: np.ndarray,
           vector: np.ndarray | None = None, compress: bool = False) -> Gathered:
    """Retrieve with the whole message (its situation names the case), then weigh the evidence on its question:
    the contexts' cosine to the question, the share of the question's rare words they hold, their best sentence."""
    from pipelines.retrieval.responses import retrieve

    query_class, hits = retrieve(conn, settings, asked.message, k, mode=mode, filters=filters, rerank=rerank,
                                 vector=message_vector if vector is None else vector)
    contexts = _contexts(conn, hits)
    focus = message_vector
    if asked.situation:
        focus = embed_query(embedder, asked.focus)
        _focus_similarities(conn, embedder.model_key, contexts, focus)
    if compress:
        contexts = _compressed(embedder, focus, contexts)
    terms = ev.question_terms(conn, asked.question, filters.readable(conn).keys, filters.as_of)
    named = ev.question_codes(asked.question)
    lexemes = _read_contexts(conn, contexts, terms, [*query_class.identifiers, *named])
    held = code_holders(contexts, query_class.identifiers, named, terms, lexemes)
    scope = [c for c in contexts if c.n <= EXTRACT_CONTEXTS or c.n in held]  # what may answer
    ranked = ranked_sentences(embedder, focus, scope, terms, lexemes)
    if vector is not None and not asked.situation:  # HyDE: the contexts' cosines are to a passage a model made up,
        calibration = replace(calibration, left_out_ceiling=None)  # not to a question like the probes'
    return Gathered(contexts, lexemes, held, ranked, weigh(contexts, query_class.identifiers, held, ranked,
                                                            calibration, named))


def probe_features(conn: psycopg.Connection, settings: Settings, embedder, probes: list,
                   groups: list[str], progress: Progress = NO_PROGRESS) -> list[list[float]]:
    """The evidence features (evidence.FEATURES) of each calibration probe (pipelines/answers/calibration.py) as
    `answer_question` would weigh its question for a caller in these groups, without the documents it leaves out;
    `progress` advances by one a probe."""
    remembering = _Remembering(embedder)
    vectors = remembering.embed([p.question for p in probes])
    features = []
    for probe, vector in zip(probes, vectors):
        weighed = gather(conn, settings, remembering, asked(probe.question), 5, mode="qa_first", rerank=False,
                         filters=Filters(groups=list(groups), left_out=probe.left_out), calibration=DEFAULT,
                         message_vector=vector).found
        features.append([weighed[f] for f in ev.FEATURES])
        progress.advance()
    return features


def answer_question(conn: psycopg.Connection, settings: Settings, question: str, k: int = 5, *, mode: str = "qa_first",
                    filters: Filters | None = None, rerank: bool = True, hyde: bool = False,
                    compress: bool = False) -> dict:
    from pipelines.retrieval.responses import query_embedder

    timings: dict[str, float] = {}
    started = time.perf_counter()
    filters = filters or Filters()
    embedder = query_embedder(conn, settings)
    client = openai_client(settings) if settings.chat_model else None
    read = normalised_query(question)  # as the documents were read: full-width letters, a terminal's colour codes
    message = asked(read)
    message_vector = embed_query(embedder, message.message)  # once: retrieval, and the evidence without a situation
    vector = None
    if hyde:
        if client is None:
            raise ChatNotConfigured("HyDE needs a chat model: set KB_CHAT_MODEL")
        vector = embed_query(embedder, complete(client, settings.chat_model, HYDE_PROMPT.format(question=read)))
    calibration = current(conn, embedder.model_key, filters.groups)
    gathered = gather(conn, settings, embedder, message, k, mode=mode, filters=filters, rerank=rerank,
                      calibration=calibration, message_vector=message_vector, vector=vector, compress=compress)
    contexts, lexemes, held, ranked, found = (gathered.contexts, gathered.lexemes, gathered.held, gathered.ranked,
                                              gathered.found)
    timings["retrieve_s"] = round(time.perf_counter() - started, 3)
    result = {"question": question, "asked": {"question": message.question, "situation": message.situation,
                                              "kind": message.kind},
              "mode": mode, "generator": f"chat:{settings.chat_model}" if client else "extractive",
              "confidence": found["confidence"], "exact_match": bool(found["code_held"]), "evidence": found,
              "calibration": calibration.describe(), "short_answer": None, "yes_no": None,
              "contexts": [_shown(c) for c in contexts], "timings": timings}
    if not found["answers"]:
        return _abstain(result, contexts, found["why"])
    started = time.perf_counter()
    pool = [c for c in contexts if c.n in held] or contexts[:EXTRACT_CONTEXTS]
    if client is not None:
        prompt = PROMPT + (YES_NO_PROMPT if message.yes_no else "")
        reply = complete(client, settings.chat_model, prompt.format(
            question=read, contexts="\n".join(f"[{c.n}] {c.label()} {c.text}" for c in contexts)))
        if DECLINES.search(reply):
            timings["generate_s"] = round(time.perf_counter() - started, 3)
            return _abstain(result, contexts, "the model found no answer in the contexts")
        reply = without_labels(reply)
        if message.yes_no and (verdict := ev.YES_OR_NO.match(reply)):
            result["yes_no"] = verdict.group(1).lower()
        sentences, unsupported = _supported(conn, _cited_sentences(reply, contexts), contexts, lexemes)
    else:
        asks = not message.yes_no and asks_for_value(message.question)
        sentences, unsupported = _extract(pool, ranked, message.question if asks else None, message.yes_no,
                                          set(found["nearer_than_ceiling"])), []
        if not message.yes_no:  # from the first sentence that holds one
            result["short_answer"] = next(filter(None, (short_answer(message.question, s) for s, _ in sentences)), None)
    timings["generate_s"] = round(time.perf_counter() - started, 3)
    started = time.perf_counter()
    kept, removed = _verified(conn, embedder, sentences, contexts, filters)
    timings["verify_s"] = round(time.perf_counter() - started, 3)
    result["removed"] = unsupported + removed
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


def _focus_similarities(conn: psycopg.Connection, model_key: str, contexts: list[Context], focus: np.ndarray) -> None:
    """Each context's cosine to the question of a message with a situation (its stored vector: no embedding)."""
    from pipelines.storage.vectors import vector_table

    rows = conn.execute(sql.SQL("SELECT c.chunk_id, v.embedding FROM chunks c JOIN {} v USING (text_hash)"
                                " WHERE c.chunk_id = ANY(%s)").format(vector_table(conn, model_key)),
                        ([c.chunk_id for c in contexts],)).fetchall()
    vectors = {chunk_id: np.asarray(vector.to_numpy(), dtype=np.float32) for chunk_id, vector in rows}
    for context in contexts:
        if context.chunk_id in vectors:
            context.similarity = float(vectors[context.chunk_id] @ focus)


def code_holders(contexts: list[Context], codes: list[str], asked: list[str], terms: dict[str, float],
                 lexemes: dict[str, set[str]]) -> list[int]:
    """The contexts the code rule answers from (their numbers). `codes` are the question's rare codes (the query
    classifier's identifiers), `asked` every code-shaped token in it: a context that holds every one of them,
    whole, and at least CODE_COVERAGE of the question's rare vocabulary (contexts' coverage already set; NR-9 held
    by a price list does not answer "the maximum payload of the NR-9"). A context whose document's title holds the
    codes holds them too, as the lexical arm reads it, but the title names the document, not what is asked of it:
    such a context must hold CODE_COVERAGE of the rest (the question's rare words, `terms`, besides the codes' and
    the title's; all of it when nothing is left). A deck titled "Q3 2024 Sales Review" answers "What was the Q3 2024
    revenue?" from its revenue slide, and not "... the Q3 2024 headcount?" from that slide. `lexemes`: as
    _read_contexts read them, the codes' too."""
    if not codes:
        return []
    wanted = {*codes, *asked}
    coded = set().union(*(lexemes[code] for code in wanted))
    held = []
    for c in contexts:
        if all(ev.holds_code(f"{c.section} {c.text}", code) for code in wanted):
            coverage = c.coverage
        elif all(ev.holds_code(_read(c), code) for code in wanted):
            rest = {term: weight for term, weight in terms.items()
                    if term not in coded and term not in lexemes[c.title or ""]}
            coverage = round(ev.coverage(rest, _said(c, lexemes)), 4) if rest else 1.0
        else:
            continue
        if coverage >= ev.CODE_COVERAGE:
            held.append(c.n)
    return held


def _read(context: Context) -> str:
    """What the code rules read of a context: its document's title, section heading and text (held_instead reads
    every context so, code_holders those that hold the codes only in their title)."""
    return f"{context.title or ''} {context.section} {context.text}"


def weigh(contexts: list[Context], codes: list[str], held: list[int], ranked: list[ev.Candidate],
          calibration: Calibration = DEFAULT, named: tuple[str, ...] | list[str] = ()) -> dict:
    """Whether the contexts answer the question, and the evidence for it (contexts' coverage already set): the
    calibrated confidence (calibration.py) over the contexts and the best sentence of the first EXTRACT_CONTEXTS of
    them (`ranked`, best first), a closest context above the calibration's left-out ceiling, or the code rule
    (`held`, from code_holders). Never when the question names a code (`named`) that no context holds while one
    holds another of its make: "HR-2024-048?" was answered with HR-2024-047's policy."""
    dense = max((c.similarity for c in contexts if c.similarity is not None), default=0.0)
    top = max(contexts, key=lambda c: c.similarity if c.similarity is not None else -1.0, default=None)
    lexical = max((c.coverage for c in contexts), default=0.0)
    of_top = top.coverage if top else 0.0
    best = next((c.score for c in ranked if c.context <= EXTRACT_CONTEXTS), 0.0)
    score = calibration.confidence([dense, lexical, of_top, best])
    ceiling = calibration.left_out_ceiling  # the probes' cosines are rounded as this returns them, and from k=5
    near = max((c.similarity for c in contexts if c.n <= EXTRACT_CONTEXTS and c.similarity is not None), default=0.0)
    closer = ceiling is not None and round(near, 4) > ceiling
    nearer = [c.n for c in contexts if closer and score < calibration.answer_at and c.n <= EXTRACT_CONTEXTS
              and c.similarity is not None and round(c.similarity, 4) > ceiling]  # what the ceiling answers from
    whole = " ".join(_read(c) for c in contexts)
    instead = {code: other for code in named if (other := ev.held_instead(whole, code))}
    answers = bool(contexts) and not instead and (bool(held) or score >= calibration.answer_at or closer)
    shown = math.floor(score * 100 + 1e-9) / 100  # cut, not rounded: a refused 0.496 is not "0.50 < 0.5"
    weighed = (f"confidence {shown:.2f} {'>=' if score >= calibration.answer_at else '<'} {calibration.answer_at}"
               f" ({calibration.origin} calibration; closest context's similarity {dense:.2f}; the contexts hold"
               f" {lexical:.0%} of the question's rare words)")
    if not contexts:
        why = "nothing readable matches the question"
    elif instead:
        why = "; ".join(f"the documents hold {other}, not {code}" for code, other in instead.items())
    elif held:
        why = f"answered: a context holds {', '.join(codes)} with the rest of the question"
    elif answers and score < calibration.answer_at:
        why = (f"answered: the closest context's similarity {near:.4f} is above any that a question about a"
               f" document the knowledge base lacks reached in its calibration ({ceiling:.4f}), though {weighed}")
    elif answers:
        why = f"answered: {weighed}"
    else:
        why = (f"the evidence that the documents answer this is too weak: {weighed}"
               + (f"; no context holds {', '.join(codes)} with the rest of the question" if codes else ""))
    return {"confidence": round(score, 4), "dense": round(dense, 4), "lexical": round(lexical, 4),
            "lexical_of_dense_top": round(of_top, 4), "best_sentence": round(best, 4), "codes": codes,
            "code_held": held, "nearer_than_ceiling": nearer, "answers": answers, "why": why}


def _shown(context: Context) -> dict:
    data = asdict(context)
    data.pop("sentences")
    return data


def _read_contexts(conn: psycopg.Connection, contexts: list[Context], terms: dict[str, float],
                   codes: list[str]) -> dict[str, set[str]]:
    """Split the contexts into the sentences that may answer and read every sentence's, heading's and title's
    lexemes, and the question's `codes`' (for code_holders), in one round trip; sets each context's coverage.
    Returns lexemes by text."""
    for context in contexts:
        context.sentences = ev.answer_sentences(context.text)
    texts = list(dict.fromkeys([s for c in contexts for s in c.sentences] + [c.section for c in contexts]
                               + [c.via_card for c in contexts if c.via_card] + [c.title or "" for c in contexts]
                               + codes))
    lexemes = dict(zip(texts, ev.lexemes(conn, texts)))
    for context in contexts:
        context.coverage = round(ev.coverage(terms, _said(context, lexemes)), 4)
    return lexemes


def _said(context: Context, lexemes: dict[str, set[str]]) -> set[str]:
    """The lexemes a context says itself: its heading's, its card question's and its sentences' (not its title's)."""
    return set().union(lexemes[context.section], lexemes.get(context.via_card or "", set()),
                       *(lexemes[s] for s in context.sentences))

# A source label as kb writes it, `[source:document, section]` or `[document.ext, section]`: text that looks like one
# inside a document or a model's reply is not kb's, and would cite what nobody checked.
_LABEL = re.compile(r"\s*\[(?:[\w.-]+:[^\]\n]*|[^\]\n,]+\.[A-Za-z0-9]{1,5}(?:,[^\]\n]*)?)\]")


def without_labels(text: str) -> str:
    return " ".join(_LABEL.sub("", text).split())


def _abstain(result: dict, contexts: list[Context], reason: str) -> dict:
    result.update(abstained=True, reason=reason, answer=f"The answer was {NOT_FOUND}.", sentences=[],
                  closest_sources=[{"document": c.document, "page": c.page, "section": c.section, "chunk_id": c.chunk_id,
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
            card = hit.source_chunk_id is not None
            contexts[chunk_id] = Context(len(contexts) + 1, chunk_id, f"{hit.source}:{hit.document}",
                                         " > ".join(hit.section_path), text, hit.dense_score, hit.page,
                                         hit.question if card else None, hit.content if card else None, hit.title)
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


def ranked_sentences(embedder, question_vector: np.ndarray, contexts: list[Context], terms: dict[str, float],
                     lexemes: dict[str, set[str]]) -> list[ev.Candidate]:
    """The contexts' sentences that may answer, scored (evidence.score_candidates), best first: the best one's
    score is evidence for answering at all, and the answer is taken from them."""
    candidates = [ev.Candidate(s, c.n, context_similarity=c.similarity or 0.0, context_coverage=c.coverage,
                               coverage=ev.coverage(terms, lexemes[s] | lexemes[c.section]))
                  for c in contexts for s in c.sentences]
    if not candidates:
        return []
    return ev.score_candidates(candidates, embedder.embed([c.text for c in candidates]), question_vector)


def _extract(pool: list[Context], ranked: list[ev.Candidate], value_question: str | None = None,
             yes_no: bool = False, near: set[int] = frozenset()) -> list[tuple[str, list[int]]]:
    """A Q&A card that matches the question answers with its answer. Otherwise the best-scored sentence of the pool
    that does not itself ask (ASKS; the best one when all do), and the next best of the same context when it scores
    nearly as well. `value_question`: the question, when it asks for a value only an entity gives
    (short_answer.asks_for_value: "when", "how many"...); then the answer is the best sentence near the top (within
    EXTRACT_MARGIN of the best) that, with its companion, holds such a value, and the best sentence as always when
    none does. (Refusing then was measured and taken back: bench/README.md.) `yes_no`: the question asks yes or no,
    and a sentence stating what was sought ("we asked whether ...", "Objective: ...") repeats it without deciding
    it, so the best sentence that does not is taken: from the best sentence's document (the question's words point
    to it; its conclusion may be another chunk), else from any, else the best as always. (Letting another document's
    sentence win when it scored more than EXTRACT_MARGIN above was measured: it cited the wrong document more often,
    bench/README.md.) `near`: the contexts the left-out ceiling answered for (weigh's nearer_than_ceiling): the
    answer is theirs when they hold a sentence, not the best of a distant context ("spare parts price list" was
    answered with a manual's sentence at similarity 0.20). Whether kb answers at all is weighed on the best sentence
    as before (weigh)."""
    card = pool[0] if pool and pool[0].card_answer and (pool[0].similarity or 0) >= ev.CARD_MATCH else None
    if card is not None:
        return [(card.card_answer, [card.n])]
    numbers = {c.n for c in pool}
    ranked = [c for c in ranked if c.context in numbers]
    ranked = [c for c in ranked if not ASKS.search(c.text)] or ranked
    ranked = [c for c in ranked if c.context in near] or ranked
    if yes_no:
        document = {c.n: c.document for c in pool}
        deciding = [c for c in ranked if not ev.states_what_is_sought(c.text)]
        ranked = [c for c in deciding if document[c.context] == document[ranked[0].context]] or deciding or ranked
    if not ranked:
        return []

    def with_next(at: int) -> list[ev.Candidate]:
        best = ranked[at]
        return [best] + [c for c in ranked[at + 1:at + 2]
                         if c.context == best.context and c.score >= best.score - EXTRACT_MARGIN]

    chosen = with_next(0)
    if value_question is not None:
        near = (with_next(at) for at, c in enumerate(ranked[:VALUE_CANDIDATES])
                if c.score >= ranked[0].score - EXTRACT_MARGIN)
        chosen = next((sentences for sentences in near
                       if any(short_answer(value_question, c.text) is not None for c in sentences)), chosen)
    return [(c.text, [c.context]) for c in chosen]


def _supported(conn: psycopg.Connection, sentences: list[tuple[str, list[int]]], contexts: list[Context],
               lexemes: dict[str, set[str]]) -> tuple[list[tuple[str, list[int]]], list[dict]]:
    """A model's sentences with only the citations of contexts that say them (evidence.support): a wrong context
    number, or every number copied from the prompt, is dropped; a sentence no cited context says is removed."""
    by_number = {c.n: c for c in contexts}
    context_lexemes = {c.n: set().union(lexemes[c.section], *(lexemes[s] for s in c.sentences)) for c in contexts}
    claims = ev.lexemes(conn, [ev.YES_OR_NO.sub("", text) for text, _ in sentences])  # a verdict is not a claim
    kept, removed = [], []
    for (text, numbers), claim in zip(sentences, claims):
        if not numbers or any(n not in by_number for n in numbers):
            kept.append((text, numbers))  # _verified names what is missing
            continue
        saying = [n for n in dict.fromkeys(numbers)
                  if ev.support(claim, text, context_lexemes[n], by_number[n].text) >= ev.SUPPORT_MIN]
        if saying:
            kept.append((text, saying))
        else:
            removed.append({"text": text, "why": f"cited context {numbers} does not say this"})
    return kept, removed


def _cited_sentences(reply: str, contexts: list[Context]) -> list[tuple[str, list[int]]]:
    """(sentence without its citation marks, context numbers it cites) for each sentence of the model's reply."""
    sentences, verdict = [], ""
    for sentence in split_sentences(AFTER_THE_STOP.sub(r"\2\1", reply)):
        numbers = [int(n) for group in CITATION.findall(sentence) for n in group.split(",")]
        text = CITATIONS.sub("", sentence).strip()
        if not numbers and ev.YES_OR_NO.fullmatch(text):  # "Yes." alone: the verdict of the sentence that follows
            verdict = text.rstrip(" .!") + ", "
        elif text:
            sentences.append((verdict + text, numbers))
            verdict = ""
    return sentences


def _verified(conn: psycopg.Connection, embedder, sentences: list[tuple[str, list[int]]], contexts: list[Context],
              filters: Filters) -> tuple[list[dict], list[dict]]:
    """Each sentence's citations checked against their chunks (pipelines/answers/citations.py). Kept: every citation VALID
    or WEAK. Removed: a sentence citing nothing, a context number that does not exist, or an INVALID chunk."""
    by_number = {c.n: c for c in contexts}
    claims, removed = [], []
    for text, numbers in sentences:
        unknown = [n for n in numbers if n not in by_number]
        if not numbers or unknown:
            removed.append({"text": text, "why": "cites no context" if not numbers else f"cites missing context {unknown}"})
        else:
            claims.append({"text": text, "citations": [by_number[n].chunk_id for n in dict.fromkeys(numbers)]})
    verdicts = validate_citations(conn, embedder, claims, [c.chunk_id for c in contexts],
                                  filters.readable(conn),
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
