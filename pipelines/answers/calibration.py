"""Answerability calibrated on the knowledge base itself, per embedding model (issue 31).

Whether kb answers is a logistic model of the evidence its contexts give (evidence.FEATURES). Weights fitted once on
one public data set (SQuAD with MiniLM) did not transfer: other domains, other question styles and other embedders
put the same evidence at other values (an OpenAI embedder's cosines are not MiniLM's). So each knowledge base fits
its own, on probes it builds from its own chunks and runs through the very code that answers:

- *answerable*: a question whose answer is a known chunk: the chunk's Q&A card question, else its most telling
  sentence, cut to about two thirds of its content words ("What employees split leave two blocks?"), so the probe
  shares words with its chunk as a person's question does, not all of them; and the same with one word of middling
  rarity swapped for a word the knowledge base never uses (probe_words.txt), as a person's own wording would;
- *left_out*: the same two questions asked as if the chunk's document were not in the knowledge base (the filters'
  `left_out`): a question about a document it does not hold, on a topic it does hold, which is what makes
  out-of-corpus questions hard to refuse. The pair differs in one thing only, whether the answer is there.

No other kind is probed: each probe is a retrieval and the embedding of its contexts' sentences (about 0.1 s on two
cores), and the fit only weighs these two. A *near miss* (the rarest word swapped: on the topic, not said) was probed
and reported until issue 32, never fitted on; it was a fifth of a first ingest's calibration.

The fit weighs answerable and left_out probes equally, so it answers at a confidence of 0.5 (ANSWER_AT): where the
fit finds a probe as likely to be either. (It used to answer at the step of 0.05 with the best balanced accuracy on
the probes; refitted on resamples of the same probes, that step moved from 0.3 to 0.8 on PubMedQA's knowledge base
and from 0.45 to 0.65 on COVID-QA's: it followed the sample's noise, not the knowledge base; a fit made then keeps
its step until its next refit.) It also keeps the *left-out ceiling*: the highest cosine any left_out probe's
closest context reached (when left_out probes of CEILING_DOCUMENTS documents found one). A question whose closest
context is closer than that is answered whatever its confidence. The confidence weighs whether one sentence answers,
and the probes, made from sentences, teach it nothing else; but people often ask about a topic as a whole
("vasculitis: what can we do?", "what should I do about this burn?"), and find the right passage at a cosine no
question about a document the knowledge base lacks reached, with no one sentence that matches them. The ceiling is
the most cautious such line the probes allow: a left_out probe above it would have been answered (MEDIQA's consumer
questions, bench/README.md). It is kept in the fit's report; a fit made before it has none until its next refit.

A fit is per model and per scope (the sources every caller reads, and each group's), so that what a caller is told
never depends on documents it cannot read; a scope with fewer than MIN_CHUNKS chunks keeps the default weights
(evidence.CONFIDENCE_WEIGHTS, fitted on SQuAD), and says so. The ingest flow's `calibrate` stage refits a scope when
the model has none, when what the scope may read was declared otherwise since, or when a run changed at least
REFIT_SHARE of its chunks.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from pipelines.answers import evidence as ev
from pipelines.ingest.report import NO_PROGRESS, Progress
from pipelines.retrieval.readable import DOCUMENTS, Readable, readable

ANSWER_AT = 0.5  # the fit weighs both kinds of probe equally: at 0.5 a question is as likely either (module docstring)
MIN_CHUNKS = 20  # fewer chunks than this in a scope: too few probes to fit five weights, the default serves
PROBE_CHUNKS = 60  # chunk texts (a card question or a sentence) a fit draws probes from, four probes each
DRAWN = 4  # chunks read per chunk needed: the drawn ones may hold no sentence to ask about
REFIT_SHARE = 0.1  # a run that changed this share of a scope's chunks refits it
RIDGE = 1.0  # probes can be separable: the penalty keeps the weights finite and close to zero where data is thin
KEEP_WORDS = 0.5
REWORDED = 1  # the share of a source sentence's content words a probe keeps
MAX_GROUP_SCOPES = 8  # groups calibrated besides the public scope (the largest ones)
# The left-out ceiling stands on left_out probes of at least this many documents that found a context: with fewer, a
# question about a left-out document finds only unrelated ones (in a one-document scope nothing, cosine 0), and
# what it reached says nothing about a missing document on a topic the knowledge base holds.
CEILING_DOCUMENTS = 10
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*[A-Za-z]|\d[\d.,]*\d|\d")
PROBE_WORDS = Path(__file__).with_name("probe_words.txt")

FITS = """
SELECT calibration_id, model_key, scope_group, fitted_at, chunks, weights, answer_at, report, sources, hidden
FROM answer_calibrations WHERE model_key = %(model)s AND (scope_group = '' OR scope_group = ANY(%(groups)s))
ORDER BY chunks DESC, fitted_at DESC
"""
OF_SCOPE = """
SELECT calibration_id, scope_group, fitted_at, chunks, sources, hidden
FROM answer_calibrations WHERE model_key = %(model)s AND scope_group = %(group)s ORDER BY fitted_at DESC LIMIT 1
"""
SCOPE_CHUNKS = sql.SQL("""
SELECT count(*) FILTER (WHERE c.valid_to IS NULL),
       count(*) FILTER (WHERE c.valid_from > %(since)s OR c.valid_to > %(since)s)
FROM chunks c JOIN documents d USING (document_id)
WHERE c.kind <> 'card' AND (c.valid_to IS NULL OR c.valid_to > %(since)s) AND {}
""").format(DOCUMENTS)
SAMPLE = sql.SQL("""
SELECT c.chunk_id, d.source_id, d.locator, c.text,
       (SELECT k.question FROM chunks k WHERE k.source_chunk_id = c.chunk_id AND k.valid_to IS NULL
        ORDER BY k.chunk_id LIMIT 1)
FROM chunks c JOIN documents d USING (document_id)
WHERE c.valid_to IS NULL AND c.kind <> 'card' AND {}
ORDER BY md5(c.text_hash), c.chunk_id LIMIT %(limit)s
""").format(DOCUMENTS)
GROUPS = """
SELECT g, count(*) FROM sources s, unnest(s.allowed_groups) AS g WHERE s.removed_at IS NULL
GROUP BY g ORDER BY count(*) DESC, g LIMIT %s
"""


@dataclass(frozen=True)
class Calibration:
    """The weights and operating point a caller's answers are decided with, and where they come from."""
    weights: tuple[float, ...]
    answer_at: float
    origin: str  # "knowledge base" or "default"
    model_key: str | None = None
    scope_group: str = ""
    chunks: int = 0
    fitted_at: datetime | None = None
    report: dict = field(default_factory=dict)
    left_out_ceiling: float | None = None  # a closest context closer than this answers (module docstring)

    def confidence(self, features: list[float]) -> float:
        bias, *weights = self.weights
        return 1 / (1 + math.exp(-(bias + float(np.dot(weights, features)))))

    def describe(self) -> dict:
        return {"origin": self.origin, "model": self.model_key, "scope": self.scope_group or "public",
                "chunks": self.chunks, "fitted_at": self.fitted_at.isoformat() if self.fitted_at else None,
                "answer_at": round(self.answer_at, 4), "weights": [round(w, 4) for w in self.weights],
                "left_out_ceiling": None if self.left_out_ceiling is None else round(self.left_out_ceiling, 4),
                **({"probes": self.report.get("probes"), "answered": self.report.get("answered"),
                    "refused": self.report.get("refused")} if self.report else {})}


DEFAULT = Calibration(ev.CONFIDENCE_WEIGHTS, ev.ANSWER_AT, "default")


def current(conn: psycopg.Connection, model_key: str, groups: list[str]) -> Calibration:
    """The calibration a caller in these groups is answered with: the largest fit of the model (the public scope's,
    or one of its groups') that read nothing the caller may not read today; the default when there is none."""
    visible = readable(conn, list(groups))
    hidden = {f"{source}\t{prefix}" for source, prefix in visible.hidden}
    for _, model, group, fitted_at, chunks, weights, answer_at, report, sources, fit_hidden in conn.execute(
            FITS, {"model": model_key, "groups": list(groups)}).fetchall():
        if set(sources) <= set(visible.ids) and {h for h in hidden if h.split("\t")[0] in sources} <= set(fit_hidden):
            return Calibration(tuple(weights), answer_at, "knowledge base", model, group, chunks, fitted_at, report,
                               report.get("left_out_ceiling"))
    return DEFAULT


def fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3, steps: int = 50,
                 sample_weight: np.ndarray | None = None) -> np.ndarray:
    """Logistic regression by Newton's method (bias first, not penalised). numpy only: five weights do not need a
    machine-learning library in the ingest path."""
    x = np.hstack([np.ones((len(x), 1)), x])
    s = np.ones(len(x)) if sample_weight is None else sample_weight
    penalty = ridge * np.eye(x.shape[1])
    penalty[0, 0] = 0.0
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-np.clip(x @ w, -30, 30)))
        gradient = x.T @ (s * (p - y)) + penalty @ w
        hessian = (x * (s * p * (1 - p))[:, None]).T @ x + penalty + 1e-9 * np.eye(len(w))
        step = np.linalg.solve(hessian, gradient)
        w -= step
        if np.abs(step).max() < 1e-8:
            break
    return w


def _content_words(text: str) -> list[str]:
    from pipelines.ingest.sentences import import_spacy

    import_spacy()  # without torch
    from spacy.lang.en.stop_words import STOP_WORDS as stop

    return [w for w in _WORD.findall(text) if w.lower() not in stop and len(w) > 1]


def _kept(words: list[str]) -> list[str]:
    """About KEEP_WORDS of the words, the same ones every time (by a hash of each), in their order; at least 3."""
    kept = [w for w in words if zlib.crc32(w.lower().encode()) % 100 < KEEP_WORDS * 100]
    return kept if len(kept) >= 3 else words[:3]


def _source_texts(text: str, card_question: str | None) -> list[str]:
    """What answerable probes of a chunk are made from, best first: its card question, then its sentences with the
    most content words (of 6 to 40 words; a heading or a table row says too little to ask about)."""
    sentences = sorted((s for s in ev.answer_sentences(text) if 6 <= len(s.split()) <= 40),
                       key=lambda s: (-len(_content_words(s)), s))
    return ([card_question] if card_question else []) + sentences


def _probe(words: list[str]) -> str:
    return f"What {' '.join(words)}?"


@dataclass
class Probe:
    chunk_id: int
    source_id: str
    locator: str  # the chunk's document
    kind: str
    question: str
    features: list[float] = field(default_factory=list)
    confidence: float = 0.0  # under the fit

    @property
    def left_out(self) -> tuple[tuple[str, str], ...]:
        """The documents the probe is asked without: its own, for a left_out probe."""
        return ((self.source_id, self.locator),) if self.kind == "left_out" else ()


def build_probes(conn: psycopg.Connection, scope: Readable, limit: int = PROBE_CHUNKS) -> list[Probe]:
    """Four probes for each of up to `limit` texts of the scope's chunks (drawn by text hash: the same chunks while
    they last): answerable and left_out, each as the chunk words it and reworded (module docstring)."""
    texts = []  # the first `limit` chunks drawn that have something to ask about (a table, a log line may not)
    for chunk_id, source, locator, text, question in conn.execute(
            SAMPLE, {**scope.params(), "limit": limit * DRAWN}).fetchall():
        if found := _source_texts(text, question):
            texts.append((chunk_id, source, locator, found))
            if len(texts) == limit:
                break
    # One text per chunk, then a second one of each, and so on: a small knowledge base still gets `limit` probes.
    sources = [(chunk_id, source, locator, found[n]) for n in range(max((len(t[3]) for t in texts), default=0))
               for chunk_id, source, locator, found in texts if n < len(found)][:limit]
    if not sources:
        return []
    foreign = _foreign_words(conn, scope.keys)
    kept = [_kept(_content_words(text)) for *_, text in sources]
    weights = ev.question_terms(conn, " ".join(w for words in kept for w in words), scope.keys)
    word_lexemes = ev.lexemes(conn, [w for words in kept for w in words])
    at, probes = 0, []
    for (chunk_id, source, locator, _), words in zip(sources, kept):
        rarity = [max((weights.get(x, 0.0) for x in lexemes), default=0.0)
                  for lexemes in word_lexemes[at:at + len(words)]]
        at += len(words)
        by_rarity = sorted(range(len(words)), key=lambda n: (-rarity[n], n))
        # Drawn by the probe's own words: a chunk's id depends on what else was ingested first, hidden sources too,
        # and a public fit must not (what a caller is told never depends on what it cannot read).
        stranger = foreign[zlib.crc32(" ".join(words).encode()) % len(foreign)]
        middling = set(by_rarity[len(by_rarity) // 3:][:REWORDED])
        reworded = [stranger if n in middling else w for n, w in enumerate(words)]
        probes += [Probe(chunk_id, source, locator, kind, _probe(question)) for kind, question in (
            ("answerable", words), ("answerable", reworded), ("left_out", words), ("left_out", reworded))]
    return probes


def _foreign_words(conn: psycopg.Connection, source_keys: list[int]) -> list[str]:
    """The probe words no readable chunk holds (as lexemes): a rewording the knowledge base cannot match."""
    words = [w for line in PROBE_WORDS.read_text().splitlines() if not line.startswith("#") for w in line.split()]
    held = ev.question_terms(conn, " ".join(words), source_keys)
    ceiling = max(held.values(), default=0.0)
    absent = {lexeme for lexeme, weight in held.items() if weight >= ceiling - 1e-9}
    return [w for w, lexemes in zip(words, ev.lexemes(conn, words)) if lexemes and lexemes <= absent] or words


def fit(probes: list[Probe]) -> tuple[tuple[float, ...], dict]:
    """(weights, report) from probes with their features: answerable against left_out, each side weighed equally
    (the fit answers at ANSWER_AT). The report says what it answers and refuses of them there, and holds the
    left-out ceiling: the highest cosine a left_out probe's closest context reached, when left_out probes of
    CEILING_DOCUMENTS documents or more found one (else None: no such rule)."""
    x = np.array([p.features for p in probes], dtype=float)
    kinds = np.array([probe.kind for probe in probes])
    y = (kinds == "answerable").astype(float)
    positives, negatives = max(y.sum(), 1.0), max(len(y) - y.sum(), 1.0)
    w = fit_logistic(x, y, RIDGE, sample_weight=np.where(y == 1, 0.5 / positives, 0.5 / negatives) * len(y))
    p = 1 / (1 + np.exp(-(w[0] + x @ w[1:])))
    report = {"probes": {k: int((kinds == k).sum()) for k in ("answerable", "left_out")},
              "answered": {"answerable": round(float((p[y == 1] >= ANSWER_AT).mean()), 3)},
              "refused": {"left_out": round(float((p[y == 0] < ANSWER_AT).mean()), 3)} if (y == 0).any() else {},
              "left_out_ceiling": _left_out_ceiling(probes)}
    for probe, confidence in zip(probes, p):
        probe.confidence = float(confidence)
    return tuple(float(v) for v in w), report


def _left_out_ceiling(probes: list[Probe]) -> float | None:
    """The highest cosine a left_out probe's closest context reached, if left_out probes of CEILING_DOCUMENTS
    documents found one; else None."""
    dense = ev.FEATURES.index("dense")
    reached = [(p.features[dense], (p.source_id, p.locator)) for p in probes
               if p.kind == "left_out" and p.features[dense] > 0]
    if len({document for _, document in reached}) < CEILING_DOCUMENTS:
        return None
    return max(cosine for cosine, _ in reached)


def scopes(conn: psycopg.Connection) -> list[str]:
    """The scopes fitted: the public one ('') and the largest groups' (MAX_GROUP_SCOPES)."""
    return [""] + [g for g, _ in conn.execute(GROUPS, (MAX_GROUP_SCOPES,)).fetchall()]


def needs_fit(conn: psycopg.Connection, model_key: str, group: str, changed: bool = True) -> tuple[bool, int, str]:
    """(whether the scope needs a fit, its live chunks, why). `changed`: the run published or deleted something;
    when it did not, only a scope without a fit, or whose readers' declarations changed, is looked at further."""
    scope = readable(conn, [group] if group else [])
    last = conn.execute(OF_SCOPE, {"model": model_key, "group": group}).fetchone()
    reads_changed = last is not None and (set(last[4]) != set(scope.ids) or
                                          set(last[5]) != {f"{s}\t{p}" for s, p in scope.hidden})
    if last is not None and not changed and not reads_changed:
        return False, last[3], "nothing published since the last fit"
    since = last[2] if last else datetime.fromtimestamp(0).astimezone()
    live, touched = conn.execute(SCOPE_CHUNKS, {**scope.params(), "since": since}).fetchone()
    if live < MIN_CHUNKS:
        return False, live, f"{live} chunks, fewer than {MIN_CHUNKS}: the default weights serve"
    if last is None:
        return True, live, "no fit for this model yet"
    if reads_changed:
        return True, live, "what the scope may read changed since the last fit"
    if touched >= REFIT_SHARE * max(last[3], 1):
        return True, live, f"{touched} chunks changed since the last fit ({last[3]} then)"
    return False, live, f"{touched} chunks changed since the last fit: under {REFIT_SHARE:.0%}"


def calibrate(conn: psycopg.Connection, settings, embedder, *, changed: bool = True,
              force: bool = False, progress: Progress = NO_PROGRESS) -> list[dict]:
    """Refit each scope that needs it (needs_fit; all of them with `force`) for the serving model, and forget the
    fits of groups no source names any more; one dict per scope saying what was done. `progress` counts the probes
    (each a retrieval and its evidence: the stage's time)."""
    from pipelines.answers.answer import probe_features

    done, fitted = [], scopes(conn)
    conn.execute("DELETE FROM answer_calibrations WHERE scope_group <> ALL(%s)", (fitted,))
    for group in fitted:
        due, live, why = needs_fit(conn, embedder.model_key, group, changed)
        if not (due or (force and live >= MIN_CHUNKS)):
            done.append({"scope": group or "public", "fitted": False, "why": why})
            continue
        scope = readable(conn, [group] if group else [])
        probes = build_probes(conn, scope)
        if not probes:
            kept = conn.execute(OF_SCOPE, {"model": embedder.model_key, "group": group}).fetchone()
            done.append({"scope": group or "public", "fitted": False,
                         "why": "no probe: no chunk drawn holds a Q&A card or a sentence of 6 to 40 words to ask about;"
                                f" {'the last fit keeps serving' if kept else 'the default weights serve'}"})
            continue
        progress.total(len(probes))
        for probe, features in zip(probes, probe_features(conn, settings, embedder, probes,
                                                          [group] if group else [], progress)):
            probe.features = features
        weights, report = fit(probes)
        with conn.transaction():
            calibration_id = conn.execute(
                "INSERT INTO answer_calibrations (model_key, scope_group, chunks, sources, hidden, weights, answer_at,"
                " report) VALUES (%s, %s, %s, %s, %s, %s, %s, %s) RETURNING calibration_id",
                (embedder.model_key, group, live, scope.ids, [f"{s}\t{p}" for s, p in scope.hidden], list(weights),
                 ANSWER_AT, Jsonb(report))).fetchone()[0]
            with conn.cursor() as cursor:
                cursor.executemany(
                    "INSERT INTO answer_probes (calibration_id, probe, chunk_id, source_id, kind, question, features,"
                    " confidence) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
                    [(calibration_id, n, p.chunk_id, p.source_id, p.kind, p.question, p.features, p.confidence)
                     for n, p in enumerate(probes)])
            conn.execute("DELETE FROM answer_calibrations WHERE model_key = %s AND scope_group = %s"
                         " AND calibration_id < %s", (embedder.model_key, group, calibration_id))
        done.append({"scope": group or "public", "fitted": True, "why": why, "chunks": live,
                     "answer_at": ANSWER_AT, **report})
    return done


def calibration_stage(conn: psycopg.Connection, settings, changed: bool,
                      progress: Progress = NO_PROGRESS) -> "StageReport":
    """The flow's `calibrate` stage: refit what needs it (needs_fit) for the serving model. A run that published
    nothing reads a few rows per scope, so a no-op refresh stays cheap."""
    from pipelines.ingest.report import StageReport
    from pipelines.retrieval.responses import query_embedder

    report = StageReport("calibrate", ("scopes", "fitted", "probes"))
    try:
        done = calibrate(conn, settings, query_embedder(conn, settings), changed=changed, progress=progress)
    except psycopg.Error:
        raise
    except Exception as exc:  # an embedding endpoint that fails (openai's errors): the last fit keeps serving
        report.notes["calibrations"] = [{"fitted": False, "why": f"not refit: {type(exc).__name__}: {exc}"}]
        return report.finish()
    report.counts.update(scopes=len(done), fitted=sum(d["fitted"] for d in done),
                         probes=sum(sum(d.get("probes", {}).values()) for d in done))
    report.notes["calibrations"] = done
    return report.finish()
