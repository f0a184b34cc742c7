"""How well an answer run's confidence tells answerable questions from the rest (issue 31), from the JSON that
`kb eval --answers DIR --json` writes: the area under the ROC curve of the confidence for answerable against
out-of-corpus questions and against same-document unanswerable ones, beside the shares the run answered and refused.
The shares move with the operating point; the areas say whether the evidence ranks questions better at all.

With --bound, also what the evidence could do at best: the share of answerable questions answered while refusing the
share of the others that issue 31 asks (GOALS), with the threshold chosen on the run itself, for the served
confidence, for each evidence feature alone and for a logistic fit of all of them on the run's own questions
(in-sample: more than any calibration from probes can know; not an operating point, and nothing is chosen with it).

    python -m bench.answer_separation [--bound] before.json after.json ...

scikit-learn's roc_auc_score and LogisticRegression (installed with sentence-transformers).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from pipelines.answers.evidence import FEATURES

GOALS = {"out_of_corpus": 0.95, "unanswerable": 0.5}  # issue 31: the share of each group refused


def separation(run: dict) -> dict:
    questions = run["answers"]["per_question"]
    answerable = [q["confidence"] for q in questions if q["group"] == "answerable"]
    out = {"answered": run["answers"]["answers"]["answered"], "cited": run["answers"]["answers"]["citation_recall"]}
    for group in ("out_of_corpus", "unanswerable"):
        other = [q["confidence"] for q in questions if q["group"] == group]
        if answerable and other:
            out[f"refused {group}"] = round(run["answers"]["refusals"][f"recall {group}"], 3)  # kb eval's own
            out[f"AUC vs {group}"] = round(float(roc_auc_score([1] * len(answerable) + [0] * len(other),
                                                               answerable + other)), 3)
    return out


def answered_at_refusal(answerable: np.ndarray, other: np.ndarray, refused: float) -> float:
    """The share of answerable scores above the lowest threshold at or under which `refused` of the others lie."""
    threshold = np.sort(other)[math.ceil(refused * len(other)) - 1]
    return round(float((answerable > threshold).mean()), 3)


def bound(run: dict) -> dict:
    """Answered at each group's GOALS share refused, each score's threshold chosen on this run."""
    out = {}
    for group, refused in GOALS.items():
        rows = [(q["group"] == "answerable", [q["confidence"]] + [q["evidence"][f] for f in FEATURES])
                for q in run["answers"]["per_question"] if q["group"] in ("answerable", group)
                and all(f in (q.get("evidence") or {}) for f in FEATURES)]
        y = np.array([answerable for answerable, _ in rows], dtype=bool)
        if y.all() or not y.any():
            continue
        x = np.array([scores for _, scores in rows], dtype=float)
        shares = {name: answered_at_refusal(x[y, n], x[~y, n], refused)
                  for n, name in enumerate(("confidence", *FEATURES))}
        scores = LogisticRegression(C=1e3, class_weight="balanced", max_iter=1000).fit(x[:, 1:], y).decision_function(
            x[:, 1:])
        shares["all, fitted on this run"] = answered_at_refusal(scores[y], scores[~y], refused)
        out[f"answered at {refused} {group} refused ({int((~y).sum())} of them)"] = shares
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files of `kb eval --answers ... --json`")
    parser.add_argument("--bound", action="store_true", help="also the share answered at the goals' refusals")
    arguments = parser.parse_args()
    for path in arguments.runs:
        run = json.loads(path.read_text())
        print(path.name, json.dumps({**separation(run), **(bound(run) if arguments.bound else {})}))


if __name__ == "__main__":
    main()
