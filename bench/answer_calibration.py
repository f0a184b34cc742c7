"""Calibrate the answer layer's evidence (pipelines/answers/evidence.py) on an answer dataset folder
(bench/squad_answers.py makes them from SQuAD 2.0): bench/README.md, "Answers on questions nobody here wrote".

    KB_HOME=/tmp/kb-calibration python -m bench.answer_calibration /tmp/squad/calibration [--fit] \
        [--other-article complexity.json]

For every question it retrieves as `kb ask` does and records the refusal features (the best context's cosine, its
lexical evidence, the lexical evidence of the dense top context, the best sentence's score under the current
SENTENCE_WEIGHTS) and every candidate sentence's features, with whether the sentence holds a gold answer in a gold
passage. Prints the curve of the current CONFIDENCE_WEIGHTS: at each threshold the share of answerable questions
answered, citing a gold passage and holding the expected text, and the share refused of each kind of negative
(--other-article names the questions about an article that is not ingested). With --fit, fits both logistic
models (plain Newton steps, no extra dependency) and prints the weights, the curve they give and the curve of
5-fold cross-validated fits, on which the operating point is chosen; the weights are to be copied into
evidence.py (a refit of SENTENCE_WEIGHTS changes the best-sentence feature: collect again and refit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from pathlib import Path

import numpy as np

from pipelines.answers.calibration import fit_logistic
from pipelines.answers.evidence import FEATURES


def collect(dataset: Path) -> list[dict]:
    from pipelines.answers.answer import gather
    from pipelines.answers.asked import asked
    from pipelines.answers.calibration import DEFAULT
    from pipelines.evaluation.evaluate import (
        _ingest_corpus,
        _is_gold,
        holds_answer,
        load_answer_set,
    )
    from pipelines.retrieval.responses import query_embedder
    from pipelines.retrieval.search import Filters, embed_query
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
        for case in load_answer_set(dataset / "questions.jsonl"):
            found = gather(conn, settings, embedder, asked(case["question"]), 5, mode="qa_first", filters=Filters(),
                           rerank=True, calibration=DEFAULT, message_vector=embed_query(embedder, case["question"]))
            contexts, held, candidates = found.contexts, found.held, found.ranked
            found = found.found
            gold = {c.n for c in contexts if _is_gold(c.document, case["passages"])}
            rows.append({"id": case["id"], "group": case["group"],
                         "features": [found[f] for f in FEATURES],
                         "code_held": bool(held),
                         "candidates": [{"features": c.features(), "gold_passage": c.context in gold,
                                         "gold": c.context in gold and holds_answer(c.text, case["answers"])}
                                        for c in candidates]})
    return rows


def probabilities(rows: list[dict], weights) -> np.ndarray:
    x = np.array([r["features"] for r in rows])
    return 1 / (1 + np.exp(-(weights[0] + x @ np.asarray(weights[1:]))))


def out_of_fold(rows: list[dict], folds: int = 5) -> np.ndarray:
    """Each question's confidence from a model fitted without its fold (a fixed shuffle): how the fit does on
    questions it has not seen, which is what the operating point is chosen on."""
    order = np.random.default_rng(1).permutation(len(rows))
    p = np.zeros(len(rows))
    for fold in np.array_split(order, folds):
        held = set(fold.tolist())
        train = [r for n, r in enumerate(rows) if n not in held and r["group"] in ("answerable", "out_of_corpus")]
        weights = fit_logistic(np.array([r["features"] for r in train]),
                               np.array([r["group"] == "answerable" for r in train], dtype=float))
        p[fold] = probabilities([rows[n] for n in fold], weights)
    return p


def curve(rows: list[dict], p: np.ndarray, sentence_weights, other: set[str]) -> list[dict]:
    """At each threshold on confidences `p`: the share of answerable questions answered, answered citing a gold
    passage (the best-scored sentence lies in one) and answered with the expected text; the share refused of the
    out-of-corpus questions about another article (ids in `other`), of those about the left-out paragraphs of the
    ingested articles, and of the unanswerable ones; and refusal precision among answerable + out-of-corpus."""
    best = [max(r["candidates"], key=lambda c: float(np.dot(sentence_weights, c["features"])), default=None)
            for r in rows]
    kinds = [r["group"] if r["group"] != "out_of_corpus" else "other article" if r["id"] in other
             else "left-out paragraph" for r in rows]
    out = []
    for threshold in np.round(np.arange(0.05, 0.951, 0.05), 2):
        answered = [r["code_held"] or q >= threshold for r, q in zip(rows, p)]
        share = lambda kind, hit: round(float(np.mean([hit(a, b) for a, b, k in zip(answered, best, kinds)  # noqa
                                                        if k == kind])), 3)
        refused = sum(not a for a, r in zip(answered, rows) if r["group"] == "out_of_corpus")
        wrongly = sum(not a for a, r in zip(answered, rows) if r["group"] == "answerable")
        out.append({"threshold": float(threshold), "answerable answered": share("answerable", lambda a, b: a),
                    "answerable cited": share("answerable", lambda a, b: a and b is not None and b["gold_passage"]),
                    "answer holds the text": share("answerable", lambda a, b: a and b is not None and b["gold"]),
                    **{f"{kind} refused": share(kind, lambda a, b: not a)
                       for kind in ("other article", "left-out paragraph", "unanswerable")},
                    "refusal precision": round(refused / max(refused + wrongly, 1), 3)})
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
    parser.add_argument("--other-article", type=Path, action="append", default=[],
                        help="A SQuAD-format file whose questions are the out-of-corpus kind about an article that is"
                             " not ingested (the rest are about left-out paragraphs of ingested ones).")
    args = parser.parse_args()
    if args.features and args.features.exists():
        rows = json.loads(args.features.read_text())
    else:
        rows = collect(args.dataset)
        if args.features:
            args.features.write_text(json.dumps(rows))
    other = {qa["id"] for path in args.other_article for article in json.loads(path.read_text())["data"]
             for paragraph in article["paragraphs"] for qa in paragraph["qas"]}
    weights, sentence_weights = np.array(ev.CONFIDENCE_WEIGHTS), np.array(ev.SENTENCE_WEIGHTS)
    report = {}
    if args.fit:
        pos_neg = [r for r in rows if r["group"] in ("answerable", "out_of_corpus")]
        weights = fit_logistic(np.array([r["features"] for r in pos_neg]),
                               np.array([r["group"] == "answerable" for r in pos_neg], dtype=float))
        candidates = [c for r in rows if r["group"] == "answerable" for c in r["candidates"]]
        sentence_weights = fit_logistic(np.array([c["features"] for c in candidates]),
                                        np.array([c["gold"] for c in candidates], dtype=float))[1:]
        print("CONFIDENCE_WEIGHTS =", tuple(round(float(w), 2) for w in weights))
        print("SENTENCE_WEIGHTS =", tuple(round(float(w), 2) for w in sentence_weights))
        report["curve, cross-validated (5 folds)"] = curve(rows, out_of_fold(rows), sentence_weights, other)
    report["curve"] = curve(rows, probabilities(rows, weights), sentence_weights, other)
    report["sentence selection"] = selection(rows, sentence_weights)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
