"""Document-level metadata a file carries itself: title, author and dates, per format.

unstructured reports per-element metadata; the document properties (DOCX core properties, PDF info, HTML
<meta>, e-mail headers) are read here with the libraries unstructured already installs.
"""

from __future__ import annotations

import io
from datetime import date, datetime


def _iso(value) -> str | None:
    if isinstance(value, (datetime, date)):
        return value.isoformat()
    return str(value) if value else None


def _clean(meta: dict) -> dict:
    return {k: v for k, v in meta.items() if v not in (None, "", [])}


def _office(data: bytes, doc_format: str) -> dict:
    if doc_format == "docx":
        import docx

        props = docx.Document(io.BytesIO(data)).core_properties
    elif doc_format == "pptx":
        import pptx

        props = pptx.Presentation(io.BytesIO(data)).core_properties
    else:
        import openpyxl

        workbook = openpyxl.load_workbook(io.BytesIO(data), read_only=True)
        props = workbook.properties
        workbook.close()
        return {"title": props.title, "author": props.creator, "created": _iso(props.created), "modified": _iso(props.modified)}
    return {"title": props.title, "author": props.author, "created": _iso(props.created), "modified": _iso(props.modified)}


def _pdf(data: bytes) -> dict:
    import pikepdf

    with pikepdf.open(io.BytesIO(data)) as pdf:
        info = pdf.docinfo
        get = lambda key: str(info[key]) if key in info else None  # noqa: E731
        return {"title": get("/Title"), "author": get("/Author"), "created": _pdf_date(get("/CreationDate"))}


def _pdf_date(raw: str | None) -> str | None:
    """PDF dates look like D:20240315093000Z; keep the calendar date."""
    if not raw or len(raw) < 10:
        return raw
    digits = raw[2:] if raw.startswith("D:") else raw
    return f"{digits[0:4]}-{digits[4:6]}-{digits[6:8]}" if digits[:8].isdigit() else raw


def _html(data: bytes) -> dict:
    import lxml.html

    tree = lxml.html.parse(io.BytesIO(data))
    meta = {m.get("name", "").lower(): m.get("content") for m in tree.iter("meta") if m.get("name")}
    title = tree.findtext(".//title")
    return {"title": title.strip() if title else None, "author": meta.get("author"),
            "created": meta.get("date") or meta.get("dcterms.created") or meta.get("dc.date")}


def _email(data: bytes) -> dict:
    from email import policy
    from email.parser import BytesParser

    message = BytesParser(policy=policy.default).parsebytes(data, headersonly=True)
    sent = message["date"]
    return {"title": message["subject"], "author": message["from"], "to": message["to"],
            "created": _iso(sent.datetime) if sent is not None and getattr(sent, "datetime", None) else None}


def file_metadata(data: bytes, doc_format: str) -> dict:
    """Best-effort metadata from a file's bytes; a file whose properties cannot be read still parses (its text is
    what matters)."""
    readers = {"docx": _office, "pptx": _office, "xlsx": _office}
    try:
        if doc_format in readers:
            meta = readers[doc_format](data, doc_format)
        elif doc_format == "pdf":
            meta = _pdf(data)
        elif doc_format == "html":
            meta = _html(data)
        elif doc_format == "eml":
            meta = _email(data)
        else:
            meta = {}
    except Exception:  # noqa: BLE001 - metadata is optional; the parse itself already succeeded
        meta = {}
    meta["format"] = doc_format
    return _clean(meta)
