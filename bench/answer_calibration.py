"""Calibrate the answer layer's evidence (pipelines/answers/evidence.py) on an answer dataset folder
(bench/squad_answers.py makes them from SQuAD 2.0): bench/README.md, "Answers on questions nobody here wrote".

    KB_HOME=/tmp/kb-calibration python -m bench.answer_calibration /tmp/squad/calibration [--fit]

For every question it retrieves as `kb ask` does and records the refusal features (the best context's cosine, its
lexical evidence, the lexical evidence of the dense top context) and every candidate sentence's features, with
whether the sentence holds a gold answer in a gold passage. Prints the refusal precision/recall curve of the
current CONFIDENCE_WEIGHTS; with --fit, fits both logistic models (plain Newton steps, no extra dependency) and
prints the weights and the curve they give, to be copied into evidence.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import numpy as np


def collect(dataset: Path) -> list[dict]:
    from pipelines.answers import evidence as ev
    from pipelines.answers.answer import EXTRACT_CONTEXTS, _contexts, _read_contexts, weigh
    from pipelines.evaluation.evaluate import _ingest_corpus, _is_gold, holds_answer, load_answer_set
    from pipelines.retrieval.responses import query_embedder, retrieve
    from pipelines.retrieval.search import visible_sources
    from pipelines.settings import load_settings
    from pipelines.storage.database import connect, ensure_database
    from pipelines.storage.database import database_url as server_url

    name = re.sub(r"[^a-z0-9]+", "_", dataset.resolve().name.lower())
    settings = load_settings()
    settings = dataclasses.replace(settings, database_url=ensure_database(server_url(settings),
                                                                          f"kb_eval_answers_{name}"))
    rows = []
    with connect(settings) as conn:
        _ingest_corpus(conn, settings, f"answers-{name}", dataset / "corpus.jsonl", None)
        embedder = query_embedder(conn, settings)
        keys = list(visible_sources(conn, []).values())
        for case in load_answer_set(dataset / "questions.jsonl"):
            query_class, hits = retrieve(conn, settings, case["question"], 5, mode="qa_first")
            contexts = _contexts(conn, hits)
            terms = ev.question_terms(conn, case["question"], keys)
            lexemes = _read_contexts(conn, contexts, terms)
            found = weigh(contexts, terms, query_class.identifiers, ev.question_codes(case["question"]))
            candidates = [ev.Candidate(s, c.n, context_similarity=c.similarity or 0.0, context_coverage=c.coverage,
                                       coverage=ev.coverage(terms, lexemes[s] | lexemes[c.section]))
                          for c in contexts[:EXTRACT_CONTEXTS] for s in c.sentences]
            if candidates:
                ev.score_candidates(candidates, embedder.embed([c.text for c in candidates]),
                                    embedder.embed([case["question"]])[0])
            gold = {c.n for c in contexts if _is_gold(c.document, case["passages"])}
            rows.append({"group": case["group"], "features": [found["dense"], found["lexical"],
                                                              found["lexical_of_dense_top"]],
                         "code_held": bool(found["code_held"]),
                         "candidates": [{"features": c.features(), "gold_passage": c.context in gold,
                                         "gold": c.context in gold and holds_answer(c.text, case["answers"])}
                                        for c in candidates]})
    return rows


def fit_logistic(x: np.ndarray, y: np.ndarray, ridge: float = 1e-3, steps: int = 50) -> np.ndarray:
    """Logistic regression by Newton's method (bias first)."""
    x = np.hstack([np.ones((len(x), 1)), x])
    w = np.zeros(x.shape[1])
    for _ in range(steps):
        p = 1 / (1 + np.exp(-x @ w))
        gradient = x.T @ (p - y) + ridge * w
        hessian = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(len(w))
        w -= np.linalg.solve(hessian, gradient)
    return w


def curve(rows: list[dict], weights, negatives=("out_of_corpus",)) -> list[dict]:
    """At each threshold: the share of answerable questions answered and of the negatives refused, and refusal
    precision among answerable + negatives."""
    score = lambda f: 1 / (1 + np.exp(-(weights[0] + np.dot(weights[1:], f))))  # noqa: E731
    out = []
    for threshold in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9):
        answered = lambda r: r["code_held"] or score(r["features"]) >= threshold  # noqa: E731
        pos = [r for r in rows if r["group"] == "answerable"]
        neg = [r for r in rows if r["group"] in negatives]
        refused_neg = sum(not answered(r) for r in neg)
        refused_pos = sum(not answered(r) for r in pos)
        out.append({"threshold": threshold, "answerable answered": round(1 - refused_pos / len(pos), 3),
                    "refused (recall)": round(refused_neg / len(neg), 3),
                    "refusal precision": round(refused_neg / max(refused_neg + refused_pos, 1), 3)})
    return out


def selection(rows: list[dict], weights) -> dict:
    """How often the best-scored sentence holds a gold answer in a gold passage, on answerable questions."""
    pos = [r for r in rows if r["group"] == "answerable"]
    top1 = top2 = passage = 0
    for r in pos:
        ranked = sorted(r["candidates"], key=lambda c: -float(np.dot(weights, c["features"])))
        top1 += bool(ranked) and ranked[0]["gold"]
        passage += bool(ranked) and ranked[0]["gold_passage"]
        top2 += any(c["gold"] for c in ranked[:2])
    return {"questions": len(pos), "best sentence right": round(top1 / len(pos), 3),
            "best sentence in a gold passage": round(passage / len(pos), 3),
            "one of the best two right": round(top2 / len(pos), 3),
            "any candidate right": round(sum(any(c["gold"] for c in r["candidates"]) for r in pos) / len(pos), 3)}


def main() -> None:
    from pipelines.answers import evidence as ev

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--features", type=Path, help="Read (or write, when missing) the collected features here.")
    args = parser.parse_args()
    if args.features and args.features.exists():
        rows = json.loads(args.features.read_text())
    else:
        rows = collect(args.dataset)
        if args.features:
            args.features.write_text(json.dumps(rows))
    weights, sentence_weights = np.array(ev.CONFIDENCE_WEIGHTS), np.array(ev.SENTENCE_WEIGHTS)
    if args.fit:
        pos_neg = [r for r in rows if r["group"] in ("answerable", "out_of_corpus")]
        weights = fit_logistic(np.array([r["features"] for r in pos_neg]),
                               np.array([r["group"] == "answerable" for r in pos_neg], dtype=float))
        candidates = [c for r in rows if r["group"] == "answerable" for c in r["candidates"]]
        sentence_weights = fit_logistic(np.array([c["features"] for c in candidates]),
                                        np.array([c["gold"] for c in candidates], dtype=float))[1:]
        print("CONFIDENCE_WEIGHTS =", tuple(round(float(w), 2) for w in weights))
        print("SENTENCE_WEIGHTS =", tuple(round(float(w), 2) for w in sentence_weights))
    print(json.dumps({"out_of_corpus": curve(rows, weights),
                      "out_of_corpus and unanswerable": curve(rows, weights, ("out_of_corpus", "unanswerable")),
                      "sentence selection": selection(rows, sentence_weights)}, indent=1))


if __name__ == "__main__":
    main()
