"""What cleaning does to real documents (issue 29): chunks before and after pipelines/ingest/clean.py, and search
over them.

    .venv/bin/python -m bench.cleaning DOCS_FOLDER [--home /tmp/kb-bench-cleaning]

DOCS_FOLDER holds real files other people's tools produced (bench/README.md, "Cleaning real documents", says which
and where from). For each file, parsed once, the chunker cuts the stored elements as they were parsed ("before")
and cleaned ("after"), and counts the chunks that hold a page number on a line of its own, a word broken at a line
end ("ef-\\nficient", "man- agement"), a ligature character (U+FB00-FB06), and, for a PDF with an outline
(bookmarks, the author's own table of contents), a section heading that is not in that outline (a false heading).
Then the folder is ingested twice into fresh knowledge bases, without cleaning (chunks and queries as parsed, the
behaviour of CHUNKER_VERSION chunker-2) and with it, and the queries below, written for two of the files with the
page that answers each, are searched (lexical arm and hybrid): hit@5 and MRR@10, where a hit is a chunk of that file
starting on that page or the one before. Writes bench/results/cleaning.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from contextlib import contextmanager, nullcontext
from pathlib import Path

from bench.report import print_table, write_results

# (file, query, page that answers it), written from the files' text.
QUERIES = [
    ("multi-column.pdf", "simplified two-stage framework where a context retriever first selects passages", 1),
    ("multi-column.pdf", "dense passage retriever outperforms BM25 65.2% vs 42.9% top-5 accuracy", 2),
    ("multi-column.pdf", "ablation finds other similarity functions perform comparably", 3),
    ("multi-column.pdf", "five QA datasets and the training dev test splitting", 4),
    ("multi-column.pdf", "each passage is prepended with the title of the Wikipedia article", 4),
    ("multi-column.pdf", "flexibility to adapt the retriever to each dataset, learning rate and epochs", 5),
    ("multi-column.pdf", "in-batch negative training with a similar configuration of gold negative passages", 6),
    ("multi-column.pdf", "hours to compute dense embeddings and build the FAISS index on 21 million passages", 7),
    ("libtasn1.pdf", "library for ASN.1 parsing and structures management with DER encoding", 4),
    ("libtasn1.pdf", "comments begin with two dashes and end with another", 5),
    ("libtasn1.pdf", "the REAL type and AUTOMATIC TAGS are not supported", 6),
    ("libtasn1.pdf", "header file libtasn1.h and the asn1_node type", 7),
    ("libtasn1.pdf", "asn1Parser reads a file of ASN.1 definitions and generates a C array", 8),
    ("libtasn1.pdf", "asn1Decoding benchmark and strict DER decoding options", 10),
    ("libtasn1.pdf", "value vector is not big enough ASN1_MEM_ERROR", 18),
    ("libtasn1.pdf", "error description similar to strerror", 26),
]

PAGE_LINE = re.compile(r"(?m)^\s*(?:page\s+)?\d{1,4}\s*$", re.IGNORECASE)
BROKEN = re.compile(r"[a-z]-\s+[a-z]")
LIGATURE = re.compile("[\ufb00-\ufb06]")


def _outline(path: Path) -> set[str] | None:
    """The PDF's bookmark titles, as comparable text; None when it has none."""
    from pypdf import PdfReader

    def titles(items) -> list[str]:
        return [t for item in items for t in (titles(item) if isinstance(item, list) else [item.title])]

    found = {_comparable(t) for t in titles(PdfReader(str(path)).outline)}
    return found or None


def _comparable(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()


def _false(heading: str, outline: set[str]) -> bool:
    heading = _comparable(heading)
    return not any(heading and (heading in entry or entry in heading) for entry in outline)


def chunk_shares(folder: Path) -> list[dict]:
    from pipelines.ingest.chunker import Chunker
    from pipelines.ingest.clean import clean
    from pipelines.ingest.formats import format_of
    from pipelines.ingest.parse import parse_file
    from pipelines.models.tokens import local_counter

    chunker = Chunker(local_counter())
    rows = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        doc_format = format_of(path.name)
        parsed = parse_file(str(path), doc_format)
        outline = _outline(path) if doc_format == "pdf" else None
        for when, elements in (("before", parsed.elements), ("after", clean(parsed.elements, doc_format))):
            chunks = chunker.chunk(elements, parsed.title)
            n = len(chunks) or 1
            rows.append({
                "file": path.name, "cleaning": when, "chunks": len(chunks),
                "page_number_lines": round(sum(bool(PAGE_LINE.search(c.text)) for c in chunks) / n, 3),
                "broken_words": round(sum(bool(BROKEN.search(c.text)) for c in chunks) / n, 3),
                "ligatures": round(sum(bool(LIGATURE.search(c.text)) for c in chunks) / n, 3),
                "false_headings": None if outline is None else round(
                    sum(bool(c.section_path) and _false(c.section_path[-1], outline) for c in chunks) / n, 3),
                "headings": len({c.section_path[-1] for c in chunks if c.section_path})})
    return rows


@contextmanager
def _without_cleaning():
    """kb as it was before cleaning: elements chunked as parsed, queries searched as typed (bench only)."""
    from pipelines.ingest import chunk
    from pipelines.retrieval import search

    saved = chunk.clean, chunk.normalise, search.normalise
    chunk.clean, chunk.normalise, search.normalise = (lambda elements, doc_format: elements), str, str
    try:
        yield
    finally:
        chunk.clean, chunk.normalise, search.normalise = saved


def retrieval(folder: Path, home: Path) -> list[dict]:
    from pipelines.ingest.run import ingest
    from pipelines.models.embedders import make_embedder
    from pipelines.retrieval.search import Filters, search
    from pipelines.settings import load_settings
    from pipelines.sources.declarations import add_source, declare
    from pipelines.storage.database import connect

    rows = []
    embedder = None
    for when in ("before", "after"):
        os.environ["KB_HOME"] = str(home / when)
        settings = load_settings()
        embedder = embedder or make_embedder(settings)
        wanted = sorted({name for name, _, _ in QUERIES})
        docs = home / "docs"
        shutil.rmtree(docs, ignore_errors=True)
        docs.mkdir(parents=True)
        for name in wanted:
            shutil.copy(folder / name, docs / name)
        with connect(settings) as conn:
            add_source(conn, declare("docs", docs, groups=None), "bench/cleaning.py")
            with _without_cleaning() if when == "before" else nullcontext():
                ingest(conn, embedder, settings, ["docs"])
                for arm in ("lexical", "hybrid"):
                    hits_at_5, reciprocal = 0, 0.0
                    for name, query, page in QUERIES:
                        found = search(conn, embedder, query, 10, arm=arm, filters=Filters())
                        ranks = [i for i, h in enumerate(found, 1) if h.document == name and h.page in (page, page - 1)]
                        hits_at_5 += bool(ranks and ranks[0] <= 5)
                        reciprocal += 1 / ranks[0] if ranks else 0.0
                    rows.append({"cleaning": when, "arm": arm, "queries": len(QUERIES),
                                 "hit@5": round(hits_at_5 / len(QUERIES), 3),
                                 "MRR@10": round(reciprocal / len(QUERIES), 3)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--home", type=Path, default=Path("/tmp/kb-bench-cleaning"))
    args = parser.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    args.home.mkdir(parents=True)
    shares = chunk_shares(args.folder)
    print_table(shares, ["file", "cleaning", "chunks", "page_number_lines", "broken_words", "ligatures",
                         "false_headings", "headings"])
    searched = retrieval(args.folder, args.home)
    print_table(searched, ["cleaning", "arm", "queries", "hit@5", "MRR@10"])
    print(f"wrote {write_results('cleaning', {'folder': str(args.folder), 'chunks': shares, 'search': searched})}")


if __name__ == "__main__":
    main()
