"""Identifier test sets: find the exact thing a code or a name points at, asked bare and inside a question.

    apt-get install postgresql-doc-15        # the PostgreSQL 15 manual, a real technical manual, from Debian
    .venv/bin/python -m bench.identifier_sets /tmp/idsets
    .venv/bin/kb eval /tmp/idsets/ids-postgres --split test
    .venv/bin/kb eval /tmp/idsets/ids-samples --split test

Each set is a BEIR-format dataset (corpus.jsonl, queries.jsonl, qrels/test.tsv) that `kb eval` scores. The corpus
is the chunks kb itself makes of real documents (parsed by unstructured, chunked by kb's chunker), one record per
chunk, so relevance is judged at the level kb serves: the chunk that holds the code. Documents: the bundled
samples (ids-samples) and pages of the PostgreSQL manual (ids-postgres: the SQLSTATE error code appendix and the
server configuration chapters). Codes that occur in one or two chunks become queries, in four kinds:
- digits: codes made only of digits ("23505", "30412"),
- mixed: letters and digits ("42P07", "AVX-039", "HR-2024-047"),
- suffix: codes that differ from another code only by their last letter ("2200B" beside "2200C", "SKU-88412-B"),
- name: snake_case names ("unique_violation", "max_wal_senders"),
each asked bare and inside a question ("What does status code 23505 stand for?").
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections import defaultdict
from pathlib import Path

from pipelines.ingest.chunker import Chunker
from pipelines.ingest.formats import FORMATS, format_of
from pipelines.ingest.parse import parse_file
from pipelines.models.tokens import local_counter
from pipelines.retrieval.query_class import is_quantity
from pipelines.settings import SAMPLES_DIR

POSTGRES_MANUAL = Path("/usr/share/doc/postgresql-doc-15/html")
POSTGRES_PAGES = ("errcodes-appendix.html", "runtime-config-replication.html", "runtime-config-wal.html",
                  "runtime-config-resource.html", "runtime-config-connection.html", "runtime-config-query.html",
                  "runtime-config-logging.html", "runtime-config-autovacuum.html", "runtime-config-client.html",
                  "runtime-config-locks.html", "runtime-config-error-handling.html")

CODE = re.compile(r"(?<![\w.-])(?:\d{4,}|(?=[\w-]*\d)(?=[\w-]*[A-Za-z])[A-Za-z0-9]+(?:-[A-Za-z0-9]+)*|"
                  r"[a-z][a-z0-9]*(?:_[a-z0-9]+)+)(?![\w-])")
YEAR = re.compile(r"^(19|20)\d\d$")
QUESTIONS = {
    "digits": ["What does status code {c} stand for?", "What does error {c} mean?", "Which condition is code {c}?"],
    "mixed": ["What is {c}?", "What does code {c} refer to?", "Tell me about {c}."],
    "suffix": ["What is {c}?", "What does {c} stand for?", "Which entry is {c}?"],
    "name": ["What does {c} do?", "What is {c} used for?", "Explain {c}."],
}


def kind_of(code: str, codes: set[str]) -> str:
    if code.isdigit():
        return "digits"
    if "_" in code and not any(ch.isdigit() for ch in code.replace("_", "")[:1]) and code.islower():
        return "name"
    if code[-1].isalpha() and any(other != code and other[:-1] == code[:-1] and other[-1].isalpha() for other in codes):
        return "suffix"
    return "mixed"


def chunk_records(files: list[Path], root: Path) -> list[dict]:
    """One record per chunk kb makes of each file: id `<file>#<n>`, the document title (and section) as title."""
    chunker = Chunker(local_counter())
    records = []
    for path in files:
        parsed = parse_file(str(path), format_of(path))
        for n, chunk in enumerate(chunker.chunk(parsed.elements, parsed.title)):
            heading = " > ".join([parsed.title or path.stem, *chunk.section_path[-1:]])
            records.append({"_id": f"{path.relative_to(root).as_posix()}#{n}", "title": heading, "text": chunk.text})
    return records


def build(records: list[dict], out: Path, per_kind: int, seed: int = 7) -> dict[str, int]:
    """Write the BEIR dataset for these records; returns how many queries of each kind."""
    holders: dict[str, set[str]] = defaultdict(set)
    for record in records:
        for code in CODE.findall(record["text"]):
            if not YEAR.match(code) and not is_quantity(code):  # "30s" and "32nd" are not codes
                holders[code].add(record["_id"])
    usable = {code: ids for code, ids in holders.items() if len(ids) <= 2}
    by_kind: dict[str, list[str]] = defaultdict(list)
    for code in sorted(usable):
        by_kind[kind_of(code, set(holders))].append(code)
    rng = random.Random(seed)
    queries, qrels, counts = [], [], {}
    for kind in ("digits", "mixed", "suffix", "name"):
        chosen = sorted(rng.sample(by_kind[kind], min(per_kind, len(by_kind[kind]))))
        counts[kind] = 2 * len(chosen)
        for code in chosen:
            for form, text in (("bare", code), ("question", rng.choice(QUESTIONS[kind]).format(c=code))):
                query_id = f"{kind}-{form}-{code}"
                queries.append({"_id": query_id, "text": text, "metadata": {"kind": kind, "form": form}})
                qrels += [(query_id, doc_id) for doc_id in sorted(usable[code])]
    out.mkdir(parents=True, exist_ok=True)
    (out / "qrels").mkdir(exist_ok=True)
    (out / "corpus.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    (out / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (out / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(f"{q}\t{d}\t1\n" for q, d in qrels))
    return counts


def samples_set(out: Path, per_kind: int = 12) -> dict[str, int]:
    files = sorted(p for p in (SAMPLES_DIR / "docs").rglob("*") if p.suffix.lower() in FORMATS)
    return build(chunk_records(files, SAMPLES_DIR / "docs"), out, per_kind)


def postgres_set(out: Path, per_kind: int = 60) -> dict[str, int]:
    if not POSTGRES_MANUAL.is_dir():
        raise SystemExit(f"{POSTGRES_MANUAL} is missing: apt-get install postgresql-doc-15")
    return build(chunk_records([POSTGRES_MANUAL / page for page in POSTGRES_PAGES], POSTGRES_MANUAL), out, per_kind)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    print("ids-samples", samples_set(args.out / "ids-samples"))
    print("ids-postgres", postgres_set(args.out / "ids-postgres"))


if __name__ == "__main__":
    main()
