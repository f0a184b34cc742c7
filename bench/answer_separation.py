"""How well an answer run's confidence tells answerable questions from the rest (issue 31), from the JSON that
`kb eval --answers DIR --json` writes: the area under the ROC curve of the confidence for answerable against
out-of-corpus questions and against same-document unanswerable ones, beside the shares the run answered and refused.
The shares move with the operating point; the areas say whether the evidence ranks questions better at all.

    python -m bench.answer_separation before.json after.json ...

scikit-learn's roc_auc_score (installed with sentence-transformers).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from sklearn.metrics import roc_auc_score


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="JSON files of `kb eval --answers ... --json`")
    for path in parser.parse_args().runs:
        print(path.name, json.dumps(separation(json.loads(path.read_text()))))


if __name__ == "__main__":
    main()
