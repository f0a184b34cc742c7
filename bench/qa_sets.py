"""Answer sets for `kb eval --answers` from public data that is neither SQuAD nor Wikipedia (issue 31: questions
unlike SQuAD, half of them yes/no). Each source is split BY DOCUMENT into a *dev* folder (about 1/3, to look at
and tune on) and a *heldout* folder (about 2/3, reported only). Within each folder some documents are not
ingested at all: their questions are group "out_of_corpus".

    python -m bench.qa_sets pubmedqa RAW/ori_pqal.json OUT      # writes OUT/pubmedqa-dev, OUT/pubmedqa-heldout
    python -m bench.qa_sets covidqa RAW/200421_covidQA.json OUT  # writes OUT/covidqa-dev, OUT/covidqa-heldout
    python -m bench.qa_sets mediqa RAW/MEDIQA_Task3_QA OUT        # writes OUT/mediqa-dev, OUT/mediqa-heldout

Every folder holds corpus.jsonl (_id, title, text) and questions.jsonl (id, question, answers, passages, group,
as `load_answer_set` in pipelines/evaluation/evaluate.py reads them) with two more fields the loader ignores:
"kind" (yes_no, span or other) and "situation" (true when the question is a message of several sentences).
The split is a hash of the document id, so a rebuild from the same raw file gives the same folders.

**pubmedqa**: PubMedQA PQA-L (Jin et al., EMNLP 2019), 1,000 expert-labelled yes/no/maybe questions, each the
title question of a PubMed abstract. Raw file: https://github.com/pubmedqa/pubmedqa, data/ori_pqal.json at
commit 1cbae8e92f72f20c8d3747cbb3bf5bc53554d997 (MIT licence; the abstracts are PubMed's). One corpus record per
abstract: its labelled sections and its conclusion (the "reasoning-free" setting, so the documents do say the
answer). Answerable questions are the yes and no ones, answers ["yes"] or ["no"], kind yes_no; "maybe" questions
on ingested abstracts are left out (no text a right answer must hold). Every 5th document (by hash) is not
ingested: its question, whatever its label, is out_of_corpus. No same-document unanswerable questions: one
question per abstract, and none written to be unanswerable. No situation-style questions.

**covidqa**: COVID-QA (Moeller et al., NLP-COVID workshop 2020), questions written by biomedical experts on
CORD-19 papers, SQuAD format with gold spans. Raw file: https://github.com/deepset-ai/COVID-QA,
data/question-answering/200421_covidQA.json at commit fb2eb5e249618457e5359806601086c635c8eb8f (Apache-2.0; the
papers are CORD-19's, each with its own licence, most cc-by). Each paper is cut into passages of about 1,200
characters on sentence boundaries; a question's passages are those its gold span overlaps. Every 6th paper (by
hash) is not ingested (out_of_corpus). Same-document unanswerable questions are DERIVED, not written: for about a
fifth of the ingested passages that hold an answer (by hash), the passage is withheld from the corpus when no
other passage of the paper holds any of its questions' answer texts; those questions become "unanswerable"
(field "derived": "passage_withheld": the rest of the paper is ingested, and it does not hold the answer text,
though it may paraphrase it). Answerable questions are sampled down (by hash) to keep each folder modest. No
yes/no and no situation-style questions (the dataset has none).

**mediqa**: consumer health questions (MEDIQA 2019 task 3, Ben Abacha et al., ACL-BioNLP 2019): messages people
sent to the U.S. National Library of Medicine, about a quarter of them a situation told in several sentences before
the question ("I got hurt in my left leg ankle almost 5 months ago. I went to doctor, ... what should I do?"),
typos and all, each with the passages NLM's CHiQA system retrieved for it from trusted health sites, judged by
experts (4 excellent, 3 correct but incomplete, 2 related, 1 incorrect). Raw files:
https://github.com/abachaa/MEDIQA2019, MEDIQA_Task3_QA/ at commit ae5d3826d6c841923b9db831159fef0f1b893593 (the
three sets of consumer questions: TrainingSet1-LiveQAMed, ValidationSet, TestSet-wLabels; the Alexa set of one-line
questions is left out). Split by groups of questions that share a passage or the same message (the sets repeat
some), so that no passage and no question is in both folders. The corpus of a folder is its questions' passages,
each text once. Answerable: a question with a passage judged 3 or 4, those passages gold (no
gold span: "answers" is empty). Unanswerable: every passage of the question judged 2 or 1 (related, not
answering), field "derived": "passages_judged_unanswering"; another question's passage may still answer it,
rarely. Every 5th question (by hash) is out_of_corpus: its passages are withheld, and it is left out when one of
them is also another question's, so the out-of-corpus questions left are mostly about conditions no passage of the
folder covers: the easy kind (not a missing page on a condition the folder holds).

Not used, deliberately: ConditionalQA, ShARC and anything built from gov.uk pages (the hidden set's kind), BoolQ
(Wikipedia). Tried and not reachable from here: doc2dial / MultiDoc2Dial (its data files are over the 4 MiB the
GitHub snapshots keep) and TechQA (download behind an IBM sign-in).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

DEV_SHARE = 1 / 3


def _rank(key: str, salt: str) -> float:
    """A stable pseudo-random number in [0, 1) for a key: splits that do not move when the raw file is reordered
    or the script is rerun."""
    return int(hashlib.sha1(f"{salt}:{key}".encode()).hexdigest()[:12], 16) / 16**12


def _split(key: str) -> str:
    return "dev" if _rank(key, "split") < DEV_SHARE else "heldout"


def _is_situation(question: str) -> bool:
    """A message that tells the asker's situation before it asks: two sentences or more, at least 20 words, and
    a first-person word before the last sentence ("I", "my", "we"...). The sources here have none (PubMedQA's
    "Title. Question?" titles are not), but the flag is computed rather than assumed, so that it means the same
    in every set."""
    sentences = [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z])", question.strip()) if len(s.split()) >= 3]
    told = " ".join(sentences[:-1])
    return (len(sentences) >= 2 and len(question.split()) >= 20
            and re.search(r"\b(I|I'm|I've|me|my|we|our|us)\b", told) is not None)


def _question(qid: str, text: str, answers: list[str], passages: list[str], group: str, kind: str,
              **extra) -> dict:
    return {"id": qid, "question": text, "answers": answers if group == "answerable" else [],
            "passages": passages if group == "answerable" else [], "group": group, "kind": kind,
            "situation": _is_situation(text), **extra}


def _write(out: Path, records: list[dict], questions: list[dict]) -> dict[str, int]:
    """Write one dataset folder and say what is in it."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    (out / "questions.jsonl").write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in questions))
    counts = {"passages": len(records), "questions": len(questions)}
    for q in questions:
        for key in (q["group"], f"{q['group']}/{q['kind']}", "situation" if q["situation"] else None):
            if key:
                counts[key] = counts.get(key, 0) + 1
    return counts


# PubMedQA ---------------------------------------------------------------------------------------------------

def _abstract_text(entry: dict) -> str:
    """The abstract as a reader sees it: each section under its label, then the conclusion."""
    parts = [f"{label.title()}: {text}" if label else text
             for label, text in zip(entry.get("LABELS", []) + [""] * len(entry["CONTEXTS"]), entry["CONTEXTS"])]
    return "\n\n".join(parts + [f"Conclusions: {entry['LONG_ANSWER']}"])


def build_pubmedqa(raw: Path, out: Path) -> dict[str, dict[str, int]]:
    data = json.loads(raw.read_text(encoding="utf-8"))
    folders: dict[str, tuple[list, list]] = {"dev": ([], []), "heldout": ([], [])}
    for pmid, entry in sorted(data.items()):
        records, questions = folders[_split(pmid)]
        decision, doc_id = entry["final_decision"], f"pmid-{pmid}"
        kind = "yes_no" if decision in ("yes", "no") else "other"
        if _rank(pmid, "out_of_corpus") < 0.2:
            questions.append(_question(pmid, entry["QUESTION"], [], [], "out_of_corpus", kind, label=decision))
            continue
        year = f" ({entry['YEAR']})" if entry.get("YEAR") else ""
        records.append({"_id": doc_id, "title": f"PubMed {pmid}{year}", "text": _abstract_text(entry)})
        if kind == "yes_no":
            questions.append(_question(pmid, entry["QUESTION"], [decision], [doc_id], "answerable", kind,
                                       label=decision))
    return {name: _write(out / f"pubmedqa-{name}", *parts) for name, parts in folders.items()}


# COVID-QA ---------------------------------------------------------------------------------------------------

PASSAGE_CHARS = 1200
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z0-9(\[])|\n\s*\n")
_HEADER = re.compile(r"^(https?://|SHA:|Authors:|Date:|DOI:|License:)")


def _passages(context: str) -> tuple[str, list[tuple[int, int]]]:
    """(title, [(start, end)] of passages in the context): about PASSAGE_CHARS each, cut between sentences,
    never holding the paper's metadata lines (URL, SHA, authors...), which every paper has and no question asks."""
    title = context.split("\n", 1)[0].strip()
    body_start = len(context.split("\n", 1)[0])
    for match in re.finditer(r"^.*$", context, re.M):
        if match.start() > 0 and _HEADER.match(match.group()):
            body_start = match.end()
    cuts = [body_start] + [m.end() for m in _SENTENCE_END.finditer(context, body_start)] + [len(context)]
    spans, start = [], cuts[0]
    for end in cuts[1:]:
        if end - start >= PASSAGE_CHARS or end == len(context):
            if context[start:end].strip():
                spans.append((start, end))
            start = end
    return title, spans


def _normalized(text: str) -> str:
    return " ".join("".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace()).split())


def _paper(article: dict) -> tuple[list[dict], list[dict]]:
    """One paper's passage records and its questions (answerable, with the passages the gold span overlaps)."""
    paragraph = article["paragraphs"][0]
    context, doc = paragraph["context"], str(paragraph["document_id"])
    title, spans = _passages(context)
    records = [{"_id": f"covid-{doc}-{n:03d}", "title": title, "text": context[s:e].strip()}
               for n, (s, e) in enumerate(spans)]
    questions = []
    for qa in paragraph["qas"]:
        answer = qa["answers"][0]
        a_start, a_end = answer["answer_start"], answer["answer_start"] + len(answer["text"])
        gold = [records[n]["_id"] for n, (s, e) in enumerate(spans) if s < a_end and a_start < e]
        questions.append(_question(f"covid-{qa['id']}", qa["question"].strip(), [answer["text"].strip()], gold,
                                   "answerable", "span"))
    return records, questions


def _withhold(records: list[dict], questions: list[dict]) -> tuple[list[dict], list[dict]]:
    """Same-document unanswerable questions: withhold some answer-holding passages of an ingested paper, when
    no passage kept holds the answer text of a question whose gold passage goes."""
    by_passage: dict[str, list[dict]] = {}
    for q in questions:
        if len(q["passages"]) == 1:
            by_passage.setdefault(q["passages"][0], []).append(q)
    withheld: set[str] = set()
    for passage_id, asked in sorted(by_passage.items()):
        if _rank(passage_id, "withhold") >= 0.2:
            continue
        kept = [_normalized(r["text"]) for r in records if r["_id"] != passage_id and r["_id"] not in withheld]
        if all(not any(_normalized(q["answers"][0]) in text for text in kept) for q in asked):
            withheld.add(passage_id)
    out = []
    for q in questions:
        if set(q["passages"]) & withheld:
            if set(q["passages"]) <= withheld:
                out.append({**q, "answers": [], "passages": [], "group": "unanswerable",
                            "derived": "passage_withheld"})
        else:
            out.append(q)
    return [r for r in records if r["_id"] not in withheld], out


def build_covidqa(raw: Path, out: Path, answerable_per_folder: dict[str, int] | None = None
                  ) -> dict[str, dict[str, int]]:
    """answerable_per_folder: answerable questions kept (sampled by hash), so ingest and evaluation stay short
    on a small machine; unanswerable and out-of-corpus questions are all kept."""
    caps = answerable_per_folder or {"dev": 160, "heldout": 320}
    folders: dict[str, tuple[list, list]] = {"dev": ([], []), "heldout": ([], [])}
    for article in json.loads(raw.read_text(encoding="utf-8"))["data"]:
        doc = str(article["paragraphs"][0]["document_id"])
        records, questions = _paper(article)
        folder_records, folder_questions = folders[_split(doc)]
        if _rank(doc, "out_of_corpus") < 1 / 6:
            folder_questions += [{**q, "answers": [], "passages": [], "group": "out_of_corpus"} for q in questions]
            continue
        records, questions = _withhold(records, questions)
        folder_records += records
        folder_questions += questions
    counts = {}
    for name, (records, questions) in folders.items():
        answerable = sorted((q for q in questions if q["group"] == "answerable"), key=lambda q: _rank(q["id"], "keep"))
        keep = {q["id"] for q in answerable[:caps[name]]}
        questions = [q for q in questions if q["group"] != "answerable" or q["id"] in keep]
        counts[name] = _write(out / f"covidqa-{name}", records, questions)
    return counts


# MEDIQA 2019 task 3 --------------------------------------------------------------------------------------

MEDIQA_FILES = ("MEDIQA2019-Task3-QA-TrainingSet1-LiveQAMed.xml", "MEDIQA2019-Task3-QA-ValidationSet.xml",
                "MEDIQA2019-Task3-QA-TestSet-wLabels.xml")


def _mediqa_questions(raw: Path) -> list[tuple[str, str, list[tuple[str, int]]]]:
    """(question id, message, [(passage text, expert score)]) for every consumer question of the three sets."""
    import xml.etree.ElementTree as ET
    out = []
    for name in MEDIQA_FILES:
        for question in ET.parse(raw / name).getroot().iter("Question"):
            passages = [((a.findtext("AnswerText") or "").strip(), int(a.get("ReferenceScore") or 0))
                        for a in question.iter("Answer")]
            out.append((f"{Path(name).stem.split('-')[3]}-{question.get('QID')}",
                        " ".join((question.findtext("QuestionText") or "").split()),
                        [(text, score) for text, score in passages if text]))
    return out


def _mediqa_record(text: str) -> dict:
    """A passage as a corpus record: CHiQA's passages open with their page's subject ("Noonan syndrome: ...")."""
    head = text.split(": ", 1)[0]
    return {"_id": "mediqa-" + hashlib.sha1(text.encode()).hexdigest()[:12],
            "title": head if len(head) <= 100 and head != text else "", "text": text}


def _mediqa_groups(questions: list[tuple[str, str, list[tuple[str, int]]]]) -> dict[str, str]:
    """Each question's group: the questions linked by a passage text or a message they share (the three sets repeat
    some of both), named by their first id. A group goes whole to dev or to held-out, so no passage and no question
    is in both."""
    parent = {qid: qid for qid, _, _ in questions}

    def root(qid: str) -> str:
        while parent[qid] != qid:
            parent[qid] = parent[parent[qid]]
            qid = parent[qid]
        return qid

    first: dict[str, str] = {}
    for qid, message, passages in questions:
        for key in [_normalized(message)] + [text for text, _ in passages]:
            a, b = root(qid), root(first.setdefault(key, qid))
            parent[max(a, b)] = min(a, b)
    return {qid: root(qid) for qid, _, _ in questions}


def build_mediqa(raw: Path, out: Path) -> dict[str, dict[str, int]]:
    counts, every = {}, [q for q in _mediqa_questions(raw) if q[2]]
    group = _mediqa_groups(every)
    for name in ("dev", "heldout"):
        asked = [q for q in every if _split(group[q[0]]) == name]
        outside = {qid for qid, _, _ in asked if _rank(qid, "out_of_corpus") < 0.2}
        records = {r["_id"]: r for qid, _, passages in asked if qid not in outside
                   for r in (_mediqa_record(text) for text, _ in passages)}
        questions = []
        for qid, message, passages in asked:
            ids = [_mediqa_record(text)["_id"] for text, _ in passages]
            gold = sorted({i for i, (_, score) in zip(ids, passages) if score >= 3})
            if qid in outside:
                if not set(ids) & records.keys():
                    questions.append(_question(qid, message, [], [], "out_of_corpus", "other"))
            elif gold:
                questions.append(_question(qid, message, [], gold, "answerable", "other"))
            else:
                questions.append(_question(qid, message, [], [], "unanswerable", "other",
                                           derived="passages_judged_unanswering"))
        counts[name] = _write(out / f"mediqa-{name}", list(records.values()), questions)
    return counts


BUILDERS = {"pubmedqa": build_pubmedqa, "covidqa": build_covidqa, "mediqa": build_mediqa}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", choices=sorted(BUILDERS))
    parser.add_argument("raw", type=Path, help="the raw file as downloaded (see the module docstring)")
    parser.add_argument("out", type=Path, help="folder to write <source>-dev and <source>-heldout under")
    args = parser.parse_args()
    for name, counts in BUILDERS[args.source](args.raw, args.out).items():
        print(name, json.dumps(counts))


if __name__ == "__main__":
    main()
