"""Short answers given the sentence that holds the gold answer (issue 31, item 4): bench/README.md.

    python -m bench.short_answers DEV_V2_JSON {dev,heldout} [--show N]

DEV_V2_JSON is a SQuAD 2.0 development file (Rajpurkar, Jia and Liang 2018; CC BY-SA 4.0). The one measured is the
half of the official development set that Stanford's CS224N starter code ships (github chrischute/squad,
`data/dev-v2.0.json`, 2,185,577 bytes, 16 articles). Its articles are split here once, before anything was
measured: Normans and Computational complexity theory are left out (they calibrated issue 19's weights and are
tests/data/squad-normans), the next seven are *dev* (looked at while building pipelines/answers/short_answer.py),
the last seven *held-out*. For each answerable question the sentence (spaCy sentencizer, as kb splits) that holds
its first gold span is given to `short_answer`; the short answer is right when it holds a gold answer (SQuAD's
normalisation, as `kb eval --answers` counts it). This measures the cut alone, not retrieval or the choice of the
sentence: `kb eval --answers` does that end to end.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
from pathlib import Path

ARTICLES = {
    "dev": ["Huguenot", "Steam_engine", "1973_oil_crisis", "European_Union_law", "Packet_switching",
            "Harvard_University", "Yuan_dynasty"],
    "heldout": ["Immune_system", "Scottish_Parliament", "Islamism", "Imperialism", "Warsaw", "French_and_Indian_War",
                "Force"],
}


def cases(path: Path, articles: list[str]) -> list[tuple[str, str, list[str]]]:
    """(question, the sentence holding its first gold span, gold answers) for each answerable question."""
    from pipelines.ingest.sentences import split_sentences

    data = {a["title"]: a for a in json.loads(path.read_text(encoding="utf-8"))["data"]}
    out = []
    for title in articles:
        for paragraph in data[title]["paragraphs"]:
            context, spans, at = paragraph["context"], [], 0
            for sentence in split_sentences(context):
                start = context.find(sentence, at)
                if start >= 0:
                    spans.append((start, start + len(sentence), sentence))
                    at = start + len(sentence)
            for qa in paragraph["qas"]:
                if qa.get("is_impossible") or not qa["answers"]:
                    continue
                first = qa["answers"][0]["answer_start"]
                sentence = next((s for a, b, s in spans if a <= first < b), None)
                if sentence is not None:
                    out.append((qa["question"], sentence, list(dict.fromkeys(a["text"] for a in qa["answers"]))))
    return out


def main() -> None:
    from pipelines.answers.short_answer import asked_labels, short_answer
    from pipelines.evaluation.evaluate import holds_answer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("squad", type=Path)
    parser.add_argument("split", choices=sorted(ARTICLES))
    parser.add_argument("--show", type=int, default=0, help="print this many wrong or missing short answers")
    args = parser.parse_args()
    rows = cases(args.squad, ARTICLES[args.split])
    asked, given, right, wrong = collections.Counter(), collections.Counter(), collections.Counter(), []
    for question, sentence, gold in rows:
        labels, phrases = asked_labels(question)
        kind = "none asked" if labels is None and not phrases else (labels or ("phrase",))[0]
        asked[kind] += 1
        answer = short_answer(question, sentence)
        given[kind] += answer is not None
        right[kind] += bool(answer) and holds_answer(answer, gold)
        if not (answer and holds_answer(answer, gold)):
            wrong.append((question, answer, gold))
    n = len(rows)
    print(f"{args.split}: {n} answerable questions; a short answer given for {sum(given.values()) / n:.3f}, right for"
          f" {sum(right.values()) / n:.3f} (precision {sum(right.values()) / max(sum(given.values()), 1):.3f})")
    for kind, count in asked.most_common():
        print(f"  {kind:12s} {count:5d} questions  given {given[kind] / count:.3f}  right {right[kind] / count:.3f}")
    for question, answer, gold in random.Random(1).sample(wrong, min(args.show, len(wrong))):
        print(f"{question} | {answer} | gold: {gold[:2]}")


if __name__ == "__main__":
    main()
