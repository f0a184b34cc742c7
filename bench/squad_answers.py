"""Answer sets for `kb eval --answers` from SQuAD 2.0 (crowd-written questions on Wikipedia paragraphs, answerable
and adversarially unanswerable; CC BY-SA 4.0): bench/README.md ("Answers on questions nobody here wrote").

    python -m bench.squad_answers OUT --corpus A.json [--corpus B.json] [--out-of-corpus C.json] [--limit N]
                                      [--leave-out N]

writes OUT/corpus.jsonl (one record per paragraph: _id, title, text) and OUT/questions.jsonl in the format
`kb eval --answers` reads (docs/retrieval.md): every question of the --corpus files, answerable ones with their
gold answers and paragraph, unanswerable ones with none (group "unanswerable"), and every question of the
--out-of-corpus files, whose paragraphs are not ingested (group "out_of_corpus"). --limit keeps the first N
paragraphs of each file (and their questions), for modest runs.

    python -m bench.squad_answers --split-sample QUERIES GROUND_TRUTH --exclude A.json ... OUT_A.json OUT_B.json

turns a sample of SQuAD 2.0 dev questions that comes without article titles (queries.json with id, context,
question; ground_truth.json with answers and is_impossible) into two SQuAD-format files of disjoint topics: its
paragraphs are clustered by meaning (the default local model, average-linkage cosine), and alternate clusters go
to A and B, so that B's questions are about paragraphs A does not hold. Paragraphs also found in the --exclude
files (the calibration articles) are dropped.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40]


def _paragraphs(path: Path, limit: int | None) -> list[tuple[str, str, dict]]:
    """(paragraph id, title, paragraph) for each paragraph of a SQuAD-format file, the first `limit` of each article
    when asked."""
    out = []
    for article in json.loads(path.read_text(encoding="utf-8"))["data"]:
        title = article["title"].replace("_", " ")
        for n, paragraph in enumerate(article["paragraphs"][:limit]):
            out.append((f"{_slug(article.get('id') or article['title'])}-{n:03d}", title, paragraph))
    return out


def _questions(paragraph_id: str, paragraph: dict, ingested: bool) -> list[dict]:
    rows = []
    for qa in paragraph["qas"]:
        answers = list(dict.fromkeys(a["text"] for a in qa.get("answers", [])))
        if not ingested:
            rows.append({"id": qa["id"], "question": qa["question"], "answers": [], "passages": [],
                         "group": "out_of_corpus"})
        elif qa.get("is_impossible") or not answers:
            rows.append({"id": qa["id"], "question": qa["question"], "answers": [], "passages": [],
                         "group": "unanswerable"})
        else:
            rows.append({"id": qa["id"], "question": qa["question"], "answers": answers, "passages": [paragraph_id],
                         "group": "answerable"})
    return rows


def build(out: Path, corpus: list[Path], out_of_corpus: list[Path], limit: int | None = None,
          leave_out: int | None = None) -> dict[str, int]:
    """leave_out N: every Nth paragraph of the --corpus files is not ingested either, so that some out-of-corpus
    questions are about the same articles as the corpus (the hard kind)."""
    out.mkdir(parents=True, exist_ok=True)
    records, questions = [], []
    for path in corpus:
        for n, (paragraph_id, title, paragraph) in enumerate(_paragraphs(path, limit)):
            ingested = not leave_out or n % leave_out != leave_out - 1
            if ingested:
                records.append({"_id": paragraph_id, "title": title, "text": paragraph["context"]})
            questions += _questions(paragraph_id, paragraph, ingested)
    for path in out_of_corpus:
        for paragraph_id, _, paragraph in _paragraphs(path, limit):
            questions += _questions(paragraph_id, paragraph, False)
    (out / "corpus.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    (out / "questions.jsonl").write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions))
    counts = {"paragraphs": len(records)}
    for q in questions:
        counts[q["group"]] = counts.get(q["group"], 0) + 1
    return counts


def split_sample(queries: Path, ground_truth: Path, exclude: list[Path], out_a: Path, out_b: Path,
                 clusters: int = 30) -> dict[str, int]:
    from scipy.cluster.hierarchy import fcluster, linkage

    from pipelines.models.embedders import make_embedder
    from pipelines.settings import load_settings

    truth = json.loads(ground_truth.read_text(encoding="utf-8"))
    excluded = {p["context"] for path in exclude for a in json.loads(path.read_text(encoding="utf-8"))["data"]
                for p in a["paragraphs"]}
    by_context: dict[str, list[dict]] = {}
    for q in json.loads(queries.read_text(encoding="utf-8"))["queries"]:
        if q["context"] not in excluded:
            gold = truth[q["id"]]
            answers = [{"text": t, "answer_start": -1} for t in gold["answers"] if t]
            by_context.setdefault(q["context"], []).append(
                {"id": q["id"], "question": q["question"], "answers": answers, "is_impossible": gold["is_impossible"]})
    contexts = sorted(by_context)
    vectors = make_embedder(load_settings()).embed(contexts)
    labels = fcluster(linkage(vectors, method="average", metric="cosine"), clusters, criterion="maxclust")
    articles: dict[int, dict] = {}
    for context, label in zip(contexts, labels):  # the sample has no titles: its paragraphs have no heading
        article = articles.setdefault(int(label), {"id": f"cluster-{int(label):02d}", "title": "", "paragraphs": []})
        article["paragraphs"].append({"context": context, "qas": by_context[context]})
    for half, path in ((0, out_a), (1, out_b)):
        data = [a for label, a in sorted(articles.items()) if label % 2 == half]
        path.write_text(json.dumps({"version": "v2.0", "data": data}, ensure_ascii=False))
    return {"excluded": len(excluded), "clusters": len(articles),
            **{f"paragraphs_{name}": sum(len(a["paragraphs"]) for label, a in articles.items() if label % 2 == half)
               for half, name in ((0, "a"), (1, "b"))}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--corpus", action="append", type=Path, default=[])
    parser.add_argument("--out-of-corpus", action="append", type=Path, default=[])
    parser.add_argument("--limit", type=int)
    parser.add_argument("--leave-out", type=int, help="Also leave every Nth paragraph of the corpus files out.")
    parser.add_argument("--split-sample", action="store_true")
    parser.add_argument("--exclude", action="append", type=Path, default=[])
    args = parser.parse_intermixed_args()
    if args.split_sample:
        print(split_sample(*args.paths[:2], args.exclude, *args.paths[2:4]))
    else:
        print(build(args.paths[0], args.corpus, args.out_of_corpus, args.limit, args.leave_out))


if __name__ == "__main__":
    main()
