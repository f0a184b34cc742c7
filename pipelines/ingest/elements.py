"""Parsed elements: the unit between parsing and chunking, stored so that re-chunking never re-parses."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import date
from typing import NamedTuple

import psycopg
from psycopg.types.json import Jsonb

from pipelines.storage import bulk


@dataclass
class Element:
    category: str  # unstructured's category: Title, NarrativeText, ListItem, Table, ...
    text: str
    depth: int | None = None
    page_number: int | None = None
    section_path: list[str] = field(default_factory=list)
    text_as_html: str | None = None


def with_section_paths(elements: list[Element]) -> list[Element]:
    """Each element under the path of the titles above it (a title's own path ends with itself): a title at depth d
    closes the titles at depth d or deeper."""
    headings: list[tuple[int, str]] = []  # (depth, text), outermost first
    for element in elements:
        if element.category == "Title":
            depth = element.depth or 0
            headings = [h for h in headings if h[0] < depth] + [(depth, element.text)]
        element.section_path = [h[1] for h in headings]
    return elements


TITLE_MAX_CHARS = 150  # titles are repeated in every chunk's embedded text: keep them short


def without_nul(value):
    """NUL characters removed from a string, or from every string inside a dict or list. PostgreSQL's text and
    jsonb cannot hold them, and they are never meaningful text (binary junk, UTF-16 read as bytes)."""
    if isinstance(value, str):
        return value.replace("\x00", "")
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    return value


@dataclass
class ParsedDocument:
    elements: list[Element]
    title: str | None = None
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        for element in self.elements:
            element.text = without_nul(element.text)
            element.section_path = without_nul(element.section_path)
            element.text_as_html = without_nul(element.text_as_html)
        self.metadata = without_nul(self.metadata)
        if self.title:
            self.title = " ".join(without_nul(self.title).split())[:TITLE_MAX_CHARS]


ELEMENT_COLUMNS = ("document_id", "seq", "category", "text", "depth", "page_number", "section_path", "text_as_html")


class Written(NamedTuple):
    elements: int  # element rows written
    same: int  # documents parsed again whose elements came out the same: only their parser version was written


def write_elements(conn: psycopg.Connection, parsed: list[tuple[int, str, ParsedDocument]],
                   parser_version: str) -> Written:
    """Store each (document_id, content_hash, parsed) as made by `parser_version` and mark the document parsed.

    The same bytes parsed again by another parser version (an upgrade re-parses every document) usually give the
    same output: then only the version is written, so the document is neither re-chunked nor published again.
    Elements that do change replace the stored ones; drafts built from the old ones are dropped, and a document
    whose bytes did not change loses its published key, which names its content and so would still match: its
    chunk stage builds it again, and its live chunks serve until the new ones are published."""
    reparsed = _stored_output(conn, parsed)
    same = {doc_id for doc_id, _, doc in parsed if reparsed.get(doc_id) == _output(doc)}
    changed = [item for item in parsed if item[0] not in same]
    ids = [doc_id for doc_id, _, _ in changed]
    conn.execute("UPDATE documents SET parser_version = %s WHERE document_id = ANY(%s)", (parser_version, sorted(same)))
    conn.execute("DELETE FROM elements WHERE document_id = ANY(%s)", (ids,))
    conn.execute("DELETE FROM chunk_drafts WHERE document_id = ANY(%s)", (ids,))
    rows = (
        (doc_id, seq, e.category, e.text, e.depth, e.page_number, e.section_path, e.text_as_html)
        for doc_id, _, doc in changed for seq, e in enumerate(doc.elements)
    )
    written = bulk.copy_rows(conn, "elements", ELEMENT_COLUMNS, rows)
    conn.execute(
        "UPDATE documents d SET parsed_hash = u.content_hash, parser_version = %s, title = u.title,"
        " metadata = u.metadata, doc_date = u.doc_date,"
        " published_key = CASE WHEN d.parsed_hash = u.content_hash THEN NULL ELSE d.published_key END"
        " FROM unnest(%s::bigint[], %s::text[], %s::text[], %s::jsonb[], %s::date[])"
        "   AS u(document_id, content_hash, title, metadata, doc_date)"
        " WHERE d.document_id = u.document_id",
        (parser_version, ids, [h for _, h, _ in changed], [d.title for _, _, d in changed],
         [Jsonb(d.metadata) for _, _, d in changed], [document_date(d.metadata) for _, _, d in changed]),
    )
    return Written(written, len(same))


def _output(doc: ParsedDocument) -> tuple:
    """What a parse stores, comparable with what was stored (metadata as its JSON reads back)."""
    return doc.title, json.loads(json.dumps(doc.metadata)), doc.elements


def _stored_output(conn: psycopg.Connection, parsed: list[tuple[int, str, ParsedDocument]]) -> dict[int, tuple]:
    """The stored output of the documents parsed again from the bytes their elements were made from; a changed
    document's old elements are not read."""
    rows = conn.execute(
        "SELECT d.document_id, d.title, d.metadata FROM documents d"
        " JOIN unnest(%s::bigint[], %s::text[]) AS u(document_id, content_hash)"
        "   ON d.document_id = u.document_id AND d.parsed_hash = u.content_hash",
        ([doc_id for doc_id, _, _ in parsed], [h for _, h, _ in parsed])).fetchall()
    elements = load_elements(conn, [row[0] for row in rows])
    return {doc_id: (title, meta, elements[doc_id]) for doc_id, title, meta in rows}


def document_date(metadata: dict) -> date | None:
    """The date a document carries (created, else modified), for date-range filters."""
    for key in ("created", "modified", "date"):
        value = str(metadata.get(key) or "")[:10]
        try:
            return date.fromisoformat(value)
        except ValueError:
            continue
    return None


def load_elements(conn: psycopg.Connection, document_ids: list[int]) -> dict[int, list[Element]]:
    out: dict[int, list[Element]] = {doc_id: [] for doc_id in document_ids}
    rows = conn.execute(
        "SELECT document_id, category, text, depth, page_number, section_path, text_as_html"
        " FROM elements WHERE document_id = ANY(%s) ORDER BY document_id, seq",
        (document_ids,),
    )
    for doc_id, *fields in rows:
        out[doc_id].append(Element(*fields))
    return out
