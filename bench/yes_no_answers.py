"""Extractive answers to yes/no questions: do they give the sentence that decides it? (issue 31, item 3):
bench/README.md.

    python -m bench.yes_no_answers EVAL_JSON RAW/ori_pqal.json

EVAL_JSON is the output of `kb eval --answers OUT/pubmedqa-<dev|heldout> --json` (folders by bench/qa_sets.py);
RAW/ori_pqal.json the PubMedQA PQA-L file they were built from (provenance: bench/qa_sets.py). A PubMedQA abstract
ends with its conclusion, which is what its authors' yes or no rests on (the data set's "long answer"). For each
answerable question kb answered, the answer *decides* when it holds a whole sentence of that conclusion (split as kb
splits, compared without spaces), and it *restates* when its first sentence states what was sought ("The purpose of
this study was to determine whether ...", "Objective: ..."; evidence.states_what_is_sought). Answers that cite
another abstract count as not deciding.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

CITATION_LABEL = re.compile(r"\s*\[[^\]]*\]")


def _squeezed(text: str) -> str:
    return re.sub(r"\s+", "", text)


def score(evaluation: dict, raw: dict) -> dict:
    from pipelines.answers.evidence import states_what_is_sought
    from pipelines.ingest.sentences import split_sentences

    answered = [q for q in evaluation["answers"]["per_question"] if q["group"] == "answerable" and not q["abstained"]]
    decides = restates = 0
    for question in answered:
        answer = CITATION_LABEL.sub("", question["answer"])
        conclusion = [_squeezed(s) for s in split_sentences(raw[question["id"]]["LONG_ANSWER"])]
        decides += question["cites_gold"] and any(s in _squeezed(answer) for s in conclusion)
        restates += states_what_is_sought((split_sentences(answer) or [""])[0])
    count = max(len(answered), 1)
    return {"answered": len(answered), "decides": round(decides / count, 3), "restates": round(restates / count, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("evaluation", type=Path, help="kb eval --answers ... --json output")
    parser.add_argument("raw", type=Path, help="PubMedQA's ori_pqal.json")
    args = parser.parse_args()
    evaluation = json.loads(args.evaluation.read_text(encoding="utf-8"))
    print(json.dumps(score(evaluation, json.loads(args.raw.read_text(encoding="utf-8")))))


if __name__ == "__main__":
    main()
