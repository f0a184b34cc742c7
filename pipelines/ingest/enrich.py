"""The enrich stage: what gets embedded (titles + section path + chunk text) and the entities made filterable.

The raw chunk text is stored unchanged; only `embed_text` carries the context prefix.
"""

from __future__ import annotations

import re
from datetime import datetime

import psycopg
from psycopg.types.json import Jsonb

from pipelines.ingest.hashing import hash_text
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.models.tokens import TokenCounter
from pipelines.storage import bulk

ENRICH_VERSION = "enrich-2"  # 2: titles longer than PREFIX_MAX_TOKENS are cut to it in the embedded prefix
PREFIX_MAX_TOKENS = 48  # a long title or heading trail must not eat the chunk's own budget

# Codes and identifiers: HR-2024-047, AVX-039, SKU-88412-B, 42P07, INC0012345. A code holds a digit and an
# upper-case letter, or is upper-case letters and digits joined by hyphens.
_CODE = re.compile(r"(?<![\w-])(?=[A-Za-z0-9_-]*\d)(?=[A-Za-z0-9_-]*[A-Z])[A-Z0-9][A-Za-z0-9]*(?:[-_][A-Za-z0-9]+)*(?![\w-])")
_EMAIL = re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}\b")
_URL = re.compile(r"\bhttps?://[^\s<>\"')\]]+")
_ISO_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_LONG_DATE = re.compile(rf"\b(?:(\d{{1,2}}) ({_MONTHS}) (\d{{4}})|({_MONTHS}) (\d{{1,2}}),? (\d{{4}}))\b")


def embed_prefix(title: str | None, section_path: list[str]) -> str:
    """`Title\\nSection > Subsection\\n\\n`, without repeating the title when it is also the first heading."""
    path = list(section_path)
    if title and path and path[0].strip().lower() == title.strip().lower():
        path = path[1:]
    lines = [line for line in (title or "", " > ".join(path)) if line]
    return "\n".join(lines) + "\n\n" if lines else ""


def embed_text(title: str | None, section_path: list[str], text: str) -> str:
    return embed_prefix(title, section_path) + text


def context_title(counter: TokenCounter, title: str | None) -> str | None:
    """The document title as prepended to its chunks: at most PREFIX_MAX_TOKENS of the model's tokens, so that
    every chunk keeps most of its budget for its own text. The chunker and the enricher both use this."""
    if not title:
        return title
    ends = counter.token_ends(title)
    return title if len(ends) <= PREFIX_MAX_TOKENS else title[:ends[PREFIX_MAX_TOKENS - 1]].rstrip()


def _valid_date(year: str, month: int, day: str) -> str | None:
    try:
        return datetime(int(year), month, int(day)).date().isoformat()
    except ValueError:
        return None


def extract_dates(text: str) -> list[str]:
    found = [_valid_date(y, int(m), d) for y, m, d in _ISO_DATE.findall(text)]
    months = _MONTHS.split("|")
    for d1, m1, y1, m2, d2, y2 in _LONG_DATE.findall(text):
        found.append(_valid_date(y1, months.index(m1) + 1, d1) if m1 else _valid_date(y2, months.index(m2) + 1, d2))
    return sorted({d for d in found if d})


def extract_entities(text: str) -> dict[str, list[str]]:
    """Identifiers, dates, e-mails and URLs found in the text, each list sorted and de-duplicated."""
    # Most texts hold neither "@" nor "://": the two patterns, scanned over every chunk, were a third of the stage.
    emails = set(_EMAIL.findall(text)) if "@" in text else set()
    without_links = _EMAIL.sub(" ", text) if emails else text
    urls = {u.rstrip(".,;:") for u in _URL.findall(text)} if "://" in text else set()
    if "://" in without_links:
        without_links = _URL.sub(" ", without_links)
    codes = {c for c in _CODE.findall(without_links) if len(c) >= 3 and not _ISO_DATE.fullmatch(c)}
    entities = {"codes": sorted(codes), "dates": extract_dates(text), "emails": sorted(emails), "urls": sorted(urls)}
    return {k: v for k, v in entities.items() if v}


TO_ENRICH = """
SELECT c.document_id, c.ordinal, d.title, c.section_path, c.text,
       CASE WHEN c.enrich_version IS NULL THEN c.token_count END  -- the chunker's count of the text
FROM chunk_drafts c JOIN documents d USING (document_id)
WHERE c.enrich_version IS DISTINCT FROM %(enricher)s
  AND (c.document_id, c.ordinal) > (%(after_doc)s, %(after_ordinal)s)
  AND (%(ids)s::text[] IS NULL OR d.source_id = ANY(%(ids)s))
ORDER BY c.document_id, c.ordinal
LIMIT %(limit)s
"""

ENRICHED_SHAPE = "document_id bigint, ordinal int, embed_text text, text_hash text, entities jsonb, token_count int"
ENRICHED_COLUMNS = ("document_id", "ordinal", "embed_text", "text_hash", "entities", "token_count")


def _counts(counter: TokenCounter, rows: list[tuple], titles: dict, texts: list[str]) -> list[int]:
    """The count of each embedded text: its prefix's and its draft's (the chunker's count of the text) when the
    counter's counts add up, each prefix counted once; else, or for a draft enriched before (its count is then of its
    old embedded text), the embedded text counted whole."""
    if not counter.additive:
        return counter.count(texts)
    keys = [(titles[title], tuple(path)) for _, _, title, path, _, _ in rows]
    unique = list(dict.fromkeys(keys))
    prefixes = dict(zip(unique, counter.count([embed_prefix(title, list(path)) for title, path in unique])))
    again = [n for n, row in enumerate(rows) if row[5] is None]
    recounted = dict(zip(again, counter.count([texts[n] for n in again])))
    return [recounted[n] if n in recounted else prefixes[key] + row[5] for n, (key, row) in enumerate(zip(keys, rows))]


def enrich_pending(conn: psycopg.Connection, counter: TokenCounter, source_ids: list[str] | None = None,
                   batch_size: int = 2000, progress: Progress = NO_PROGRESS) -> StageReport:
    """Fill in what gets embedded; token_count becomes the count of the embedded text, the one that must fit."""
    report = StageReport("enrich", ("chunks",))
    after = (0, 0)  # keyset pagination: drafts stream in batches, never all in memory
    params = {"enricher": ENRICH_VERSION, "ids": source_ids, "limit": batch_size}
    progress.total(conn.execute(f"SELECT count(*) FROM ({TO_ENRICH}) t",
                                {**params, "limit": None, "after_doc": 0, "after_ordinal": 0}).fetchone()[0])
    while rows := conn.execute(TO_ENRICH, {**params, "after_doc": after[0], "after_ordinal": after[1]}).fetchall():
        titles = {title: context_title(counter, title) for title in {row[2] for row in rows}}  # once a document
        texts = [embed_text(titles[title], path, text) for _, _, title, path, text, _ in rows]
        enriched = [(doc_id, ordinal, full, hash_text(full), Jsonb(extract_entities(full)), tokens)
                    for (doc_id, ordinal, *_), full, tokens in zip(rows, texts, _counts(counter, rows, titles, texts))]
        with conn.transaction():
            bulk.stage_rows(conn, "kb_enriched", ENRICHED_SHAPE, ENRICHED_COLUMNS, enriched)
            conn.execute(
                "UPDATE chunk_drafts c SET embed_text = e.embed_text, text_hash = e.text_hash, entities = e.entities,"
                " token_count = e.token_count, enrich_version = %s FROM kb_enriched e WHERE c.document_id = e.document_id AND c.ordinal = e.ordinal",
                (ENRICH_VERSION,),
            )
        report.counts["chunks"] += len(rows)
        progress.advance(len(rows))
        after = rows[-1][:2]
    return report.finish()
