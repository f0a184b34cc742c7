"""A hostile folder: good documents beside every kind of bad input kb must survive (issue 10), for the test that
ingests them in one run (tests/test_bad_day.py) and for the benchmark that measures its memory at full size
(bench/hostile.py). Also a TCP forwarder to the test database, for runs without root's file capabilities."""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import psycopg

# Sizes: "test" keeps the suite fast (with the limits below); "full" is what issue 10 reported.
SIZES = {
    "test": {"bomb_mb": 30, "huge_mb": 2.5, "token_kb": 30, "docx_paragraphs": 2000},
    "full": {"bomb_mb": 850, "huge_mb": 200, "token_kb": 300, "docx_paragraphs": 100_000},
}
# Every limit here trips by size. The parse time limit is not under test in the hostile folder (a busy machine
# parses slowly; tests/test_bad_day.py trips it with a parser that never returns), so it is out of the way.
TEST_LIMITS = {"KB_MAX_FILE_MB": "2", "KB_MAX_UNZIPPED_MB": "10", "KB_PARSE_TIMEOUT_S": "3600"}

_CONTENT_TYPES = ('<?xml version="1.0" encoding="UTF-8"?><Types xmlns="http://schemas.openxmlformats.org/package/2006/'
                  'content-types"><Default Extension="rels" ContentType="application/vnd.openxmlformats-package.relat'
                  'ionships+xml"/><Default Extension="xml" ContentType="application/xml"/><Override PartName="/word/'
                  'document.xml" ContentType="application/vnd.openxmlformats-officedocument.wordprocessingml.document'
                  '.main+xml"/></Types>')
_RELS = ('<?xml version="1.0" encoding="UTF-8"?><Relationships xmlns="http://schemas.openxmlformats.org/package/2006/'
         'relationships"><Relationship Id="rId1" Type="http://schemas.openxmlformats.org/officeDocument/2006/'
         'relationships/officeDocument" Target="word/document.xml"/></Relationships>')
_W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"


def write_docx(path: Path, paragraphs: Iterator[str]) -> None:
    """A minimal valid DOCX, streamed: it can hold 100,000 paragraphs or 850 MB of text in a small file."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("[Content_Types].xml", _CONTENT_TYPES)
        archive.writestr("_rels/.rels", _RELS)
        with archive.open("word/document.xml", "w", force_zip64=True) as body:
            body.write(f'<?xml version="1.0" encoding="UTF-8"?><w:document xmlns:w="{_W}"><w:body>'.encode())
            for text in paragraphs:
                body.write(f"<w:p><w:r><w:t>{text}</w:t></w:r></w:p>".encode())
            body.write(b"</w:body></w:document>")


def make_hostile(docs: Path, records: Path, outside: Path, scale: str = "test") -> dict[str, str]:
    """Break a copy of the sample folder (`docs`, already ingested once) and write a JSONL source (`records`, whose
    good version was ingested once) full of bad records. Returns {locator: what its failure must say}; the
    folder's `finance/` is unreadable to anyone without root's capabilities (the run must drop them). Good files
    are added too: a long base64 token, text with stray NUL bytes, a DOCX of many paragraphs (100,000 at full
    size)."""
    size = SIZES[scale]
    rng = np.random.default_rng(13)
    bad = {}

    def add(locator: str, reason: str, content: bytes | None = None) -> Path:
        path = docs / locator
        if content is not None:
            path.write_bytes(content)
        bad[locator] = reason
        return path

    add("empty.txt", "empty file", b"")
    add("corrupt.pdf", "corrupt.pdf: ", b"%PDF-1.4\n1 0 obj << /Type /Catalog >> garbage")
    (docs / "photo.png").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(64))  # skipped (listed), not a failure
    add("binary.txt", "not a text file", b"\x00\x01\x02\x00" * 4000)
    add(os.fsdecode(b"caf\xe9.md").replace("\udce9", "\\xe9"), "not valid UTF-8")
    (docs / os.fsdecode(b"caf\xe9.md")).write_text("# Menu\n\nEspresso.\n")
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_text("root:$6$salt$secret-hash:19000:0:99999:7:::\n")
    add("shadow.txt", "is a symbolic link").symlink_to(outside)
    with open(add("huge.txt", "over the"), "wb") as huge:
        for _ in range(int(size["huge_mb"])):
            huge.write(b"A long line of log output that nobody needs. " * 23_000)
        huge.write(b"tail " * 110_000)
    write_docx(add("products/spare-parts-prices.xlsx", "expands to"),  # a good document replaced by a zip bomb
               ("0" * 1_000_000 for _ in range(size["bomb_mb"])))
    write_docx(docs / "paragraphs.docx", (f"Paragraph {i} of the okapi census." for i in range(size["docx_paragraphs"])))
    token = base64.b64encode(rng.bytes(size["token_kb"] * 750)).decode()
    (docs / "ops" / "token.txt").write_text(f"Signing key for the zebra gateway: {token} (rotate yearly).\n")
    (docs / "ops" / "notes.txt").write_bytes(b"Rotate the zebra signing keys monthly.\x00\x00 Log each rotation.\n")
    (docs / "finance").chmod(0)
    bad["finance/"] = "cannot read folder"

    good = [{"_id": f"r{i}", "title": f"Record {i}", "text": f"Text of record {i} about okapis."} for i in range(8)]
    lines = [json.dumps(r).encode() for r in good]
    lines[1] = lines[1][:-8]
    lines[2] = json.dumps({"_id": "r2", "title": "", "text": " "}).encode()
    lines[3] = json.dumps({"_id": "r3", "title": "Record 3", "text": None}).encode()
    lines[4] = b'{"_id": "r4", "title": "Record 4", "text": "a lone \\ud800 surrogate"}'
    lines[5] = b'{"_id": "r5", "title": "Record 5", "text": "caf\xe9"}'
    lines += [json.dumps({"_id": "r6", "title": "Copy", "text": "A second r6."}).encode(),
              b'{"_id": "r7", "title": "Record 7", "text": "The\\u0000 okapi record with a NUL."}']
    del lines[7]
    records.write_bytes(b"\n".join(lines) + b"\n")
    bad.update({"r1": "not valid JSON", "r2": "no title and no text", "r3": "text is null", "r4": "surrogate",
                "r5": "not valid UTF-8", "r6": "is on lines"})
    return bad


def good_records(records: Path) -> None:
    records.write_text("".join(json.dumps({"_id": f"r{i}", "title": f"Record {i}",
                                           "text": f"Text of record {i} about okapis."}) + "\n" for i in range(8)))


@contextmanager
def tcp_to_database(url: str) -> Iterator[str]:
    """The database at `url` (a unix-socket server) reachable over TCP on localhost, through a small forwarder:
    for child processes that cannot open the server's socket folder (running without root's file capabilities)."""
    info = psycopg.conninfo.conninfo_to_dict(url)
    socket_path = f"{info['host']}/.s.PGSQL.{info.get('port') or 5432}"
    listener = socket.create_server(("127.0.0.1", 0))

    def pump(source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                target.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, target):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX)
            upstream.connect(socket_path)
            for pair in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=pair, daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield psycopg.conninfo.make_conninfo(host="127.0.0.1", port=listener.getsockname()[1],
                                             dbname=info.get("dbname") or "postgres",
                                             user=info.get("user") or "postgres", sslmode="disable")
    finally:
        listener.close()


def without_root_capabilities() -> list[str]:
    """A command prefix that runs a child as root without the capabilities that bypass file permissions, so that
    a chmod 000 folder is unreadable to it as to any ordinary account (empty when not root)."""
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
