"""Extraction: walk each source, record every document's identity, size, mtime and content hash.

A file whose size and mtime match the stored row is not read again (the cheap stat check); any other file
is hashed. JSONL records are small and already structured, so extraction also stores their elements: those of new
or changed records, and of every record whose elements another PARSER_VERSION made (pipelines/ingest/parse.py).

Nothing stored is lost to a bad day. Every problem with one file or record is a failure of that document
alone, recorded under its identity and cleared once it is fixed; a document that fails keeps its last good
version. A crawl that could not see part of its source (an unreadable folder, a missing root, a line with no
readable `_id`) deletes nothing there, and a crawl that would soft-delete more than the source's
`max_deletion_share` of its documents (an unmounted share, an emptied file) deletes nothing unless the run is
confirmed with `allow_deletions`.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import re
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import psycopg
from psycopg.types.json import Jsonb

from pipelines.ingest.elements import Element, ParsedDocument, without_nul, write_elements
from pipelines.ingest.failures import Failure, record_failure
from pipelines.ingest.formats import UnsupportedFormat, format_of, supported
from pipelines.ingest.hashing import hash_bytes, hash_stream, hash_text
from pipelines.ingest.parse import PARSER_VERSION
from pipelines.ingest.report import NO_PROGRESS, Progress, StageReport
from pipelines.settings import Limits
from pipelines.sources.declarations import TREES, Source, add_coverage, load_sources, narrower
from pipelines.sources.files import (NotARegularFile, OutsideSource, RootChanged, host, identity, open_below, open_root,
                                    walk_below)
from pipelines.sources.objects import Reader, address, list_objects
from pipelines.sources.overlaps import Place, below, mounts_below, place
from pipelines.sources.tables import Rows
from pipelines.sources.web import GAP, PageError, Scope, Site, page_url
from pipelines.sources.web import crawl as web_crawl
from pipelines.storage import bulk
from pipelines.storage.locks import LOCK_NAMESPACE

STAGE = "extract"


@dataclass(frozen=True)
class Found:
    locator: str
    doc_format: str
    size: int
    mtime: datetime | None
    content_hash: str | None  # None: unchanged by the stat check (or the object's tag), keep the stored hash
    record: dict | None = None
    failed: bool = False  # a known document that could not be read: it keeps its last good version
    version_tag: str | None = None  # an object's ETag (or its store's like): read again only when it changes
    body: bytes | None = None  # a web page as fetched, kept for the parse stage (a page may differ at every request)


@dataclass
class Crawl:
    """What one crawl of a source saw, and what it could not see."""

    source: Source
    report: StageReport
    limits: Limits
    known_root: str | None = None  # the root's identity recorded on this host (None: not yet, or a new root accepted)
    root_identity: str | None = None  # what this crawl opened
    nested: frozenset[str] = frozenset()  # paths of other sources inside this one's folder: theirs, not crawled here
    roots: dict[str, Source] = field(default_factory=dict)  # device:inode of other sources' roots -> the source
    narrower_places: list[tuple[Source, "Place"]] = field(default_factory=list)  # sources fewer callers may read
    found: dict[str, "Owned"] = field(default_factory=dict)  # folders the walk found to be another source's root
    seen: set[str] = field(default_factory=set)
    unseen: list[str] = field(default_factory=list)  # folder prefixes ("" = all) the crawl could not read
    blind: bool = False  # some record could not be identified: the crawl cannot tell what is missing
    failed: set[str] = field(default_factory=set)  # failure locators of this crawl
    skip_unsupported: bool = True  # KB_UNSUPPORTED_FILES=skip: a file of a type kb does not read is listed, not failed
    unread: int = 0  # documents known unchanged without reading them (UNREAD_BY)
    known_stamp: str | None = None  # a JSONL source's stamp from its last clean crawl (sql/020_jsonl_file_stamp.sql)
    stamp: str | None = None  # the JSONL file as this crawl opened it (file_stamp)

    def fail(self, locator: str, reason: str) -> None:
        self.failed.add(locator)
        self.report.fail(Failure(self.source.source_id, locator, STAGE, reason))

    def skip(self, locator: str, reason: str) -> None:
        self.report.skip(Failure(self.source.source_id, locator, STAGE, reason))

    def hidden(self, locator: str) -> bool:
        return self.blind or any(locator.startswith(prefix) for prefix in self.unseen)


def _selected(relpath: str, source: Source) -> bool:
    if source.include and not any(fnmatch.fnmatch(relpath, g) for g in source.include):
        return False
    return not any(fnmatch.fnmatch(relpath, g) for g in source.exclude)


Known = dict[str, tuple[int, "datetime | None", str, "str | None"]]  # locator -> (size, mtime, content_hash, tag)


def _printable(name: str) -> str:
    """A path os.walk decoded with surrogate escapes, as valid text (undecodable bytes shown as \\xNN)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace")


def _regular(name: str, dir_fd: int) -> bool:
    """Whether `name` in the folder open as `dir_fd` is a regular file, without following a link."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def walk_folder(crawl: Crawl, known: Known, progress: Progress = NO_PROGRESS) -> Iterator[Found]:
    """Yield the folder's files in a stable order; hidden files and folders are skipped, links are not followed.
    Everything is listed and opened below the root's own descriptor (pipelines/sources/files.py), so a file swapped
    for a link, or a root replaced by another folder, is never read. A folder that cannot be listed is recorded,
    and nothing stored under it is deleted. The folder is listed first (cheap next to reading the files), so that
    progress knows the total."""
    source = crawl.source
    root = source.path
    if not root.is_dir():
        raise FileNotFoundError(f"source {source.source_id!r}: folder {root} does not exist or is not mounted")

    def unreadable(exc: OSError) -> None:
        relpath = os.path.normpath(exc.filename) if exc.filename else "."
        prefix = "" if relpath == "." else _printable(relpath) + "/"
        crawl.unseen.append(prefix)
        crawl.fail(prefix or ".", f"cannot read folder {_printable(str(root / relpath))}: {exc.strerror};"
                                  " documents stored under it are kept")

    with open_root(root, crawl.known_root) as root_fd:
        crawl.root_identity = identity(root_fd)
        listed: list[str] = []
        for dirpath, dirnames, filenames, dir_fd in walk_below(root_fd, onerror=unreadable):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                                 and os.path.normpath(os.path.join(dirpath, d)) not in crawl.nested
                                 and not _another_root(crawl, d, dir_fd, os.path.normpath(os.path.join(dirpath, d))))
            for name in sorted(f for f in filenames if not f.startswith(".")):
                relpath = os.path.normpath(os.path.join(dirpath, name))
                if relpath in crawl.nested or not _selected(relpath, source):
                    continue
                if _printable(relpath) != relpath:  # not valid UTF-8: it cannot be named, stored or searched
                    crawl.fail(_printable(relpath), f"{_printable(str(root / relpath))}: the file name is not valid"
                                                    " UTF-8; rename the file")
                    continue
                if crawl.skip_unsupported and not supported(relpath) and _regular(name, dir_fd):
                    # A share holds images, archives, binaries: listed, not a failure of every scheduled run. Only
                    # regular files: a link or a pipe stays a failure, whatever its name (it is never opened).
                    suffix = Path(relpath).suffix.lower() or "(no extension)"
                    crawl.skip(relpath, f"unsupported file type {suffix}")
                    continue
                listed.append(relpath)
        progress.total(len(listed))
        for relpath in listed:
            try:
                yield _inspect_file(root_fd, root, relpath, known.get(relpath), crawl)
            except (OSError, UnsupportedFormat, ValueError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                crawl.fail(relpath, f"cannot read {root / relpath}: {reason}" if isinstance(exc, OSError)
                           else f"{root / relpath}: {reason}")
                yield Found(relpath, "", 0, None, None, failed=True)


def walk_objects(crawl: Crawl, known: Known, progress: Progress = NO_PROGRESS) -> Iterator[Found]:
    """Yield the objects below the source's prefix, by key. One whose tag and size are the stored ones is not read; any
    other is read (no more than the per-file limit) and hashed. The listing is whole or the crawl fails
    (pipelines/sources/objects.py). Keys are named like a folder's files: hidden parts and other sources' prefixes
    are skipped, globs select."""
    source, url = crawl.source, crawl.source.location
    listed = []
    for obj in list_objects(url):
        relpath = obj.key
        if any(part.startswith(".") for part in relpath.split("/")) or not _selected(relpath, source) or any(
                relpath == nested or relpath.startswith(nested + "/") for nested in crawl.nested):
            continue
        if crawl.skip_unsupported and not supported(relpath):
            crawl.skip(relpath, f"unsupported file type {Path(relpath).suffix.lower() or '(no extension)'}")
            continue
        listed.append(obj)
    progress.total(len(listed))
    reader = Reader(url) if listed else None
    limit = crawl.limits.max_file_mb * 1e6
    for obj in listed:
        stored = known.get(obj.key)
        try:
            doc_format = format_of(obj.key)
            if obj.size == 0:
                raise ValueError("empty object (0 bytes)")
            if obj.size > limit:
                raise ValueError(f"the object is {obj.size / 1e6:.1f} MB, over the {crawl.limits.max_file_mb:g} MB"
                                 " limit (KB_MAX_FILE_MB)")
            if stored is not None and (stored[0], stored[3]) == (obj.size, obj.tag):
                yield Found(obj.key, doc_format, obj.size, obj.mtime, None, version_tag=obj.tag)
                continue
            data = reader.read(obj.key, limit)
            crawl.report.counts["fetched"] += 1
        except (OSError, UnsupportedFormat, ValueError) as exc:
            crawl.fail(obj.key, f"{address(url, obj.key)}: {exc}")
            yield Found(obj.key, "", 0, None, None, failed=True)
            continue
        yield Found(obj.key, doc_format, len(data), obj.mtime, hash_bytes(data), version_tag=obj.tag)


def _another_root(crawl: Crawl, name: str, dir_fd: int, relpath: str) -> bool:
    """Whether the folder `name` is another source's root, whatever path reaches it (a bind mount, a share mounted
    inside this folder): compared by device and inode, it is that source's and this crawl leaves it alone."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    owner = crawl.roots.get(f"{st.st_dev}:{st.st_ino}")
    if owner is not None:
        crawl.found[relpath] = Owned(owner, "")
    return owner is not None


def _check_link_target(crawl: Crawl, fd: int, relpath: str) -> None:
    """A source that follows links outside its folder may still not read, through a link, a file of a source fewer
    callers may read: that would serve it to more of them. The file as opened is compared, not the link's text."""
    target = place(os.readlink(f"/proc/self/fd/{fd}"))
    for other, there in crawl.narrower_places:
        if there.holds(target):
            raise OutsideSource(f"it leads into {other.path}, the folder of source {other.source_id!r}, which only"
                                f" groups {', '.join(other.groups)} may read; it is not read")


def _inspect_file(root_fd: int, root: Path, relpath: str, stored: tuple[int, datetime | None, str] | None,
                  crawl: Crawl) -> Found:
    fd = open_below(root_fd, relpath, root, crawl.source.allow_outside_links)
    if crawl.source.allow_outside_links:
        try:
            _check_link_target(crawl, fd, relpath)
        except BaseException:
            os.close(fd)
            raise
    with open(fd, "rb", closefd=True) as handle:
        doc_format = format_of(relpath)
        st = os.fstat(fd)
        mtime = datetime.fromtimestamp(st.st_mtime, tz=timezone.utc)
        if st.st_size == 0:
            raise ValueError("empty file (0 bytes)")
        if st.st_size > crawl.limits.max_file_mb * 1e6:
            raise ValueError(f"the file is {st.st_size / 1e6:.1f} MB, over the {crawl.limits.max_file_mb:g} MB limit"
                             " (KB_MAX_FILE_MB)")
        if stored is not None and stored[:2] == (st.st_size, mtime):
            return Found(relpath, doc_format, st.st_size, mtime, None)
        digest, size = hash_stream(handle)
    return Found(relpath, doc_format, size, mtime, digest)


_SALVAGE_ID = re.compile(rb'"_id"\s*:\s*(?:"((?:[^"\\]|\\.)*)"|(-?\d+))')


def _lines(handle) -> Iterator[tuple[int, bytes]]:
    handle.seek(0)
    for line_no, raw in enumerate(handle, 1):
        if raw.strip():
            yield line_no, raw


MAX_DEPTH = 32  # nesting a record may have; metadata deeper than this is not metadata anyone filters on


def _depth(value) -> int:
    """How deeply a decoded JSON value nests (iteratively: a hostile record must not exhaust the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level <= MAX_DEPTH:
                stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _decode(raw: bytes) -> tuple[dict | None, str | None]:
    """(record, None) or (None, why the line is not a record)."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 ({exc.reason} at byte {exc.start})"
    except RecursionError:
        return None, f"nested too deeply to read (at most {MAX_DEPTH} levels)"
    except ValueError as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    if _depth(record) > MAX_DEPTH:
        return None, f"nested more than {MAX_DEPTH} levels deep"
    if not isinstance(record.get("_id"), (str, int)) or isinstance(record.get("_id"), bool) or record["_id"] == "":
        return None, "the record has no _id (a string or a number)"
    return record, None


def _identity(raw: bytes, record: dict | None) -> str | None:
    """The record's _id as a locator: from the record, else salvaged from a line that is not valid JSON, so that
    a broken line is a failure of that record (which keeps its last good version) and not of the whole file."""
    if record is not None:
        locator = str(record["_id"])
    else:
        match = _SALVAGE_ID.search(raw)
        if match is None:
            return None
        try:
            locator = json.loads(b'"' + match.group(1) + b'"') if match.group(1) is not None else match.group(2).decode()
        except (ValueError, UnicodeDecodeError):
            return None
    return locator if _is_text(locator) and "\x00" not in locator else None


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _record_problem(record: dict, limits: Limits) -> str | None:
    title, text = record.get("title"), record.get("text", "")
    if title is not None and not isinstance(title, str):
        return "title must be a string"
    if text is None:
        return "text is null"
    if not isinstance(text, str):
        return "text must be a string"
    if not (title or "").strip() and not text.strip():
        return "the record has no title and no text"
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False)
    if not _is_text(canonical):
        return "it contains an unpaired surrogate (\\ud800-\\udfff), which is not valid Unicode"
    if len(canonical.encode()) > limits.max_file_mb * 1e6:
        return f"the record is over the {limits.max_file_mb:g} MB limit (KB_MAX_FILE_MB)"
    return None


def read_records(crawl: Crawl, known: Known, progress: Progress = NO_PROGRESS) -> Iterator[Found]:
    """Yield each JSONL record (`_id`, `title`, `text`, other fields as metadata). A bad record is a failure under
    its _id; a line whose _id cannot be read is a failure under "line N" and blinds the crawl (nothing deleted).
    An _id on several lines is an error for that _id: every copy is rejected and its last good version stays.
    A file opened with the stamp its last clean crawl left is not read: each known record is unchanged."""
    path = crawl.source.path
    location = str(path)
    with open_root(path.parent, crawl.known_root) as root_fd:  # the file is opened below its folder, like a file
        crawl.root_identity = identity(root_fd)                 # of a folder source, never through a link
        with open(open_below(root_fd, path.name, path.parent, crawl.source.allow_outside_links), "rb") as handle:
            crawl.stamp = file_stamp(os.fstat(handle.fileno()), crawl.limits)  # before a line is read
            if crawl.stamp is not None and f"{crawl.stamp}:{len(known)}" == crawl.known_stamp:
                progress.total(len(known))
                yield from (Found(locator, "record", row[0], None, None) for locator, row in known.items())
                return
            yield from _records(crawl, handle, location, progress)


RACY_NS = 2_000_000_000  # a file changed this recently may change again within its timestamps' granularity


def _now_ns() -> int:
    return time.time_ns()


def file_stamp(st: os.stat_result, limits: Limits) -> str | None:
    """What a JSONL file's records depend on without reading it: the file (any write changes its ctime), the limit
    and parser they were read under. The stamp recorded adds how many live documents the crawl left, which the next
    crawl compares with its own (a change made outside a crawl). None for a file changed in the last RACY_NS: a write in the same clock tick as the last could leave its
    timestamps as they were (git's "racily clean" entries), so such a file is read again next time."""
    if _now_ns() - st.st_ctime_ns < RACY_NS:
        return None
    return (f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{limits.max_file_mb:g}"
            f":{PARSER_VERSION}")


def _records(crawl: Crawl, handle, location: str, progress: Progress) -> Iterator[Found]:
    copies: Counter[str] = Counter()
    for _, raw in _lines(handle):  # first pass: which _ids repeat
        record, _ = _decode(raw)
        if (locator := _identity(raw, record)) is not None:
            copies[locator] += 1
    progress.total(len(copies))  # one item per _id, however many lines carry it
    lines_of: dict[str, list[int]] = {}
    for line_no, raw in _lines(handle):
        record, problem = _decode(raw)
        locator = _identity(raw, record)
        if locator is None:
            crawl.blind = True
            crawl.fail(f"line {line_no}", f"{location} line {line_no}: {problem}; no record is deleted while a"
                                          " line cannot be read")
            continue
        lines_of.setdefault(locator, []).append(line_no)
        if copies[locator] > 1:
            if len(lines_of[locator]) == copies[locator]:
                crawl.fail(locator, f"{location}: _id {locator!r} is on lines {', '.join(map(str, lines_of[locator]))};"
                                    " every copy is rejected and its last good version kept")
                yield Found(locator, "record", 0, None, None, failed=True)
            continue
        problem = problem or _record_problem(record, crawl.limits)
        if problem:
            crawl.fail(locator, f"{location} line {line_no} (_id {locator!r}): {problem}")
            yield Found(locator, "record", 0, None, None, failed=True)
            continue
        yield _record_found(locator, record)


def _record_found(locator: str, record: dict, version_tag: str | None = None) -> Found:
    """A valid record as found: NUL characters dropped, hashed in its canonical JSON (a JSONL line or a table row)."""
    record = without_nul(record)
    canonical = json.dumps(record, sort_keys=True, ensure_ascii=False)
    return Found(locator, "record", len(canonical.encode()), None, hash_text(canonical), record, version_tag=version_tag)


def walk_web(crawl: Crawl, known: Known, progress: Progress = NO_PROGRESS, conn: psycopg.Connection | None = None,
             ) -> Iterator[Found]:
    """Yield the pages of a web source (pipelines/sources/web.py): a 304 is an unchanged page, any other failure is
    that page's; a crawl stopped by its page or time limit, or that could not read robots.txt, deletes nothing."""
    source, limits = crawl.source, crawl.limits
    scope = Scope.of(source.location, source.private_network)

    def stored(locator: str) -> bytes | None:
        row = conn.execute("SELECT p.body FROM fetched_pages p JOIN documents d USING (document_id) WHERE"
                           " d.source_id = %s AND d.locator = %s", (source.source_id, locator)).fetchone()
        return bytes(row[0]) if row else None

    with Site(scope, limits.max_file_mb * 1e6, limits.web_timeout_s) as site:
        pages = web_crawl(site, {loc: known[loc][3] for loc in known}, stored, limits.web_max_pages,
                          limits.web_max_depth, limits.web_max_s)
        for locator, page in pages:
            progress.advance()
            if page is None or page is GAP:  # stopped early, or some pages unknown: it cannot tell what is gone
                crawl.blind = True
                crawl.fail(source.location, f"{source.location}: {locator}; no page is deleted by this crawl")
                if page is None:
                    break
                continue
            if isinstance(page, PageError):
                crawl.fail(locator, f"{page_url(scope, locator)}: {page}")
                yield Found(locator, "", 0, None, None, failed=True)
            elif page.status == 304 and locator in known:
                yield Found(locator, "html", known[locator][0], known[locator][1], None, version_tag=page.tag)
            elif page.doc_format not in ("html",) and not supported(locator):
                crawl.skip(locator, f"not a page kb reads ({page.doc_format or 'no content type'})")
            else:
                crawl.report.counts["fetched"] += 1
                if not page.body:
                    crawl.fail(locator, f"{page_url(scope, locator)}: empty page (0 bytes)")
                    yield Found(locator, "", 0, None, None, failed=True)
                    continue
                doc_format = "html" if page.doc_format == "html" else format_of(locator)
                yield Found(locator, doc_format, len(page.body), _http_time(page.last_modified),
                            hash_bytes(page.body), version_tag=page.tag, body=page.body)
        crawl.report.notes["web_requests"] = crawl.report.notes.get("web_requests", 0) + site.requests


def _http_time(value: str | None) -> datetime | None:
    from email.utils import parsedate_to_datetime

    try:
        return parsedate_to_datetime(value) if value else None
    except (TypeError, ValueError):
        return None


def walk_table(crawl: Crawl, known: Known, progress: Progress = NO_PROGRESS) -> Iterator[Found]:
    """Yield each row of a table source as a record (pipelines/sources/tables.py): rows whose version is the stored one
    are not fetched. A row with no id blinds the crawl (nothing deleted); an id on several rows is an error for that
    id, whose last good version stays, like a JSONL _id on several lines."""
    source, spec = crawl.source, crawl.source.table
    with Rows(source.location, spec, str(source.path)) as rows:
        keys = rows.keys()
        copies = Counter(row_id for row_id, _ in keys)
        progress.total(len(copies))
        wanted: dict[str, str | None] = {}
        for row_id, version in keys:
            if row_id is None:
                if not crawl.blind:
                    crawl.fail("(no id)", f"{source.path}: a row's {spec.id} is NULL; no row is deleted while one"
                                          " cannot be named")
                crawl.blind = True
            elif copies[row_id] > 1:
                if row_id not in wanted:
                    crawl.fail(row_id, f"{source.path}: {spec.id} {row_id!r} is on {copies[row_id]} rows; every copy is"
                                       " rejected and its last good version kept")
                    yield Found(row_id, "record", 0, None, None, failed=True)
                wanted.setdefault(row_id, None)
            elif spec.version and version is not None and (stored := known.get(row_id)) and stored[3] == version:
                yield Found(row_id, "record", stored[0], None, None, version_tag=version)
            else:
                wanted[row_id] = version
        fetch = [row_id for row_id in wanted if copies[row_id] == 1]
        for row_id, record in rows.records(fetch):
            crawl.report.counts["fetched"] += 1
            if problem := _record_problem(record, crawl.limits):
                crawl.fail(row_id, f"{source.path}: {spec.id} {row_id!r}: {problem}")
                yield Found(row_id, "record", 0, None, None, failed=True)
                continue
            yield _record_found(row_id, record, wanted[row_id])


def record_elements(record: dict) -> ParsedDocument:
    """A record is already structured: its title is the heading, each paragraph of its text an element."""
    title = str(record.get("title") or "").strip()
    paragraphs = [p.strip() for p in str(record.get("text") or "").split("\n\n") if p.strip()]
    path = [title] if title else []
    elements = [Element("Title", title, depth=0, section_path=path)] if title else []
    elements += [Element("NarrativeText", p, section_path=path) for p in paragraphs]
    metadata = {k: v for k, v in record.items() if k not in ("_id", "title", "text")}
    return ParsedDocument(elements, title or None, metadata)


def _known_documents(conn: psycopg.Connection, source_id: str) -> Known:
    rows = conn.execute(
        "SELECT locator, size_bytes, mtime, content_hash, version_tag FROM documents"
        " WHERE source_id = %s AND deleted_at IS NULL", (source_id,))
    return {r[0]: r[1:] for r in rows}


MERGE_DOCUMENTS = """
INSERT INTO documents AS d (source_id, locator, doc_format, size_bytes, mtime, content_hash, title, version_tag)
SELECT %(source_id)s, s.locator, s.doc_format, s.size_bytes, s.mtime, s.content_hash, s.title, s.version_tag
FROM kb_found s
ON CONFLICT (source_id, locator) DO UPDATE
    SET doc_format = excluded.doc_format, size_bytes = excluded.size_bytes, mtime = excluded.mtime,
        content_hash = excluded.content_hash, version_tag = excluded.version_tag, deleted_at = NULL
    WHERE (d.doc_format, d.size_bytes, d.mtime, d.content_hash, d.version_tag, d.deleted_at)
          IS DISTINCT FROM (excluded.doc_format, excluded.size_bytes, excluded.mtime, excluded.content_hash,
                            excluded.version_tag, NULL)
"""

# Records whose elements are not of their content, or not of this parser version (as parse.PENDING for files).
STALE_RECORDS = """
SELECT document_id, locator FROM documents
WHERE source_id = %(source_id)s AND locator = ANY(%(locators)s)
  AND (parsed_hash IS DISTINCT FROM content_hash OR parser_version IS DISTINCT FROM %(parser)s)
"""

FOUND_COLUMNS = ("locator", "doc_format", "size_bytes", "mtime", "content_hash", "title", "version_tag")
FOUND_SHAPE = ("locator text, doc_format text, size_bytes bigint, mtime timestamptz, content_hash text, title text,"
               " version_tag text")


def _merge(conn: psycopg.Connection, source_id: str, changed: list[Found]) -> None:
    bulk.stage_rows(conn, "kb_found", FOUND_SHAPE, FOUND_COLUMNS, (
        (f.locator, f.doc_format, f.size, f.mtime, f.content_hash, (f.record or {}).get("title") or None,
         f.version_tag) for f in changed))
    conn.execute(MERGE_DOCUMENTS, {"source_id": source_id})
    if pages := [f for f in changed if f.body is not None]:
        conn.execute("INSERT INTO fetched_pages (document_id, content_hash, body)"
                     " SELECT d.document_id, p.content_hash, p.body FROM unnest(%s::text[], %s::text[], %s::bytea[])"
                     " AS p(locator, content_hash, body) JOIN documents d ON d.source_id = %s AND d.locator = p.locator"
                     " ON CONFLICT (document_id) DO UPDATE SET content_hash = excluded.content_hash,"
                     " body = excluded.body", ([f.locator for f in pages], [f.content_hash for f in pages],
                                               [f.body for f in pages], source_id))
    records = {f.locator: f for f in changed if f.record is not None}
    stale = conn.execute(STALE_RECORDS, {"source_id": source_id, "locators": list(records),
                                         "parser": PARSER_VERSION}).fetchall() if records else []
    if stale:
        write_elements(conn, [(doc_id, records[locator].content_hash, record_elements(records[locator].record))
                              for doc_id, locator in stale], PARSER_VERSION)


def _write_batch(conn: psycopg.Connection, crawl: Crawl, batch: list[Found], known: Known) -> None:
    """Upsert a batch of found documents (and the elements of new, changed or stale records). A document the
    database refuses fails alone: the batch is retried one document at a time."""
    changed = [f for f in batch if not f.failed and f.content_hash is not None]
    try:
        with conn.transaction():
            _merge(conn, crawl.source.source_id, changed)
    except psycopg.DataError:
        for found in changed:
            try:
                with conn.transaction():
                    _merge(conn, crawl.source.source_id, [found])
            except psycopg.DataError as exc:
                crawl.fail(found.locator, f"{crawl.source.path}: {found.locator}: cannot be stored: {exc}")
                batch = [Found(found.locator, found.doc_format, 0, None, None, failed=True) if f is found else f
                         for f in batch]
    for f in batch:
        if not f.failed:
            stored = known.get(f.locator)
            kind = "new" if stored is None else "unchanged" if f.content_hash in (None, stored[2]) else "changed"
            crawl.report.counts[kind] += 1
            crawl.unread += kind == "unchanged" and f.content_hash is None


def _deletions(crawl: Crawl, known: Known, allow_deletions: bool) -> list[str]:
    """The live documents this crawl found missing, or none when it could not see them or when they are more
    than the source lets one crawl delete without confirmation."""
    missing = sorted(loc for loc in known if loc not in crawl.seen and not crawl.hidden(loc))
    share = len(missing) / len(known) if known else 0.0
    if missing and share > crawl.source.max_deletion_share and not allow_deletions:
        crawl.fail(str(crawl.source.path),
                   f"source {crawl.source.source_id!r}: this crawl would soft-delete {len(missing)} of {len(known)}"
                   f" live documents ({share:.0%}, more than the {crawl.source.max_deletion_share:.0%} allowed), so"
                   f" it deleted none. Is {crawl.source.path} unmounted or truncated? If the documents really are"
                   f" gone, run `kb ingest --source {crawl.source.source_id} --allow-deletions`")
        return []
    return missing


class InsideNarrower(OSError):
    """The source's folder lies inside a source that fewer callers may read (a mount or link made after both were
    declared): crawling it would serve that source's files to more callers."""


@dataclass(frozen=True)
class Owned:
    """A folder or file of this source's that is `owner`'s, at `within` inside the owner's folder ('' = its root)."""

    owner: Source
    within: str


def _neighbours(conn: psycopg.Connection, source: Source) -> tuple[dict[str, Owned], dict[str, Source]]:
    """(what of this source's folder is another source's, by its path here; the other sources' roots by device:inode,
    as they are now and as each was first crawled on this host, so a root renamed since is still known), decided on
    what the folders are at this crawl (pipelines/sources/overlaps.py): a link or a mount made since the declarations
    were checked counts, a mount below this folder included. A source whose folder lies inside one that fewer callers
    may read is not crawled."""
    here, inside, roots = place(source.path), {}, {}
    mounted = mounts_below(source.path) if source.kind == "folder" else {}
    recorded = dict(conn.execute("SELECT source_id, root_identities ->> %s FROM sources WHERE removed_at IS NULL",
                                 (host(),)).fetchall())
    for other in load_sources(conn):
        if other.source_id == source.source_id:
            continue
        there = place(other.path)
        if there.holds(here):
            if not narrower(source, other):
                add_coverage(conn, {(source.source_id, other.source_id, "")})  # its documents: not to more callers
                raise InsideNarrower(errno.EACCES, f"its folder {source.path} lies inside {other.path}, the folder of"
                                                   f" source {other.source_id!r}, which only groups"
                                                   f" {', '.join(other.groups)} may read; it is not crawled while it"
                                                   " would serve those files to more callers (declare it inside with"
                                                   " groups among those, or move it out)")
        elif folder := below(there, here):
            inside[folder] = Owned(other, "")
        else:  # a mount below this folder that shows the other's folder, or a part of it
            for point, shown in mounted.items():
                if (within := below(shown, there)) is not None:
                    inside[point] = Owned(other, within)
                elif folder := below(there, shown):
                    inside[f"{point}/{folder}"] = Owned(other, "")
        for identity in (_identity_of(other.path), recorded.get(other.source_id)):
            if identity:
                roots[identity] = other
    return inside, roots


def _identity_of(path: Path) -> str | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return f"{st.st_dev}:{st.st_ino}"


def _hand_over(conn: psycopg.Connection, crawl: Crawl, folder: str, owned: Owned, known: Known) -> None:
    """A folder or file of this source that is another source's: what this source held there goes to the owner with
    its history (sql/functions/sources.sql) when the owner's run is idle, else it is left alone this time (nothing
    there is deleted); and while the owner is restricted, no caller outside its groups reads any version of it
    here."""
    source, owner = crawl.source, owned.owner
    if owner.groups is not None:
        add_coverage(conn, {(source.source_id, owner.source_id, folder)})
    held = [locator for locator in known if locator == folder or locator.startswith(folder + "/")]
    if not held:
        return
    if owner.kind in TREES and conn.execute("SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))",
                                               (LOCK_NAMESPACE, owner.source_id)).fetchone()[0]:
        conn.execute("SELECT kb_move_documents(%s, %s, %s, %s)",
                     (source.source_id, folder, owner.source_id, owned.within))
        for locator in held:
            del known[locator]
    else:
        crawl.unseen.append(folder + "/")


BATCH_BYTES = 64_000_000  # a batch of fetched pages is written before it holds more (memory, one bytea[] parameter)


def crawl_source(conn: psycopg.Connection, source: Source, report: StageReport, limits: Limits,
                 allow_deletions: bool = False, batch_size: int = 500, progress: Progress = NO_PROGRESS,
                 accept_new_root: bool = False, skip_unsupported: bool = True) -> None:
    """Crawl one source: upsert what changed and mark what disappeared, all in one transaction (the run's gated
    publish deletes what vanished, with what it publishes). The root's identity is recorded at the first crawl on this
    host and must match afterwards, unless a new root is accepted."""
    before = report.counts.copy()
    known_root = None if accept_new_root else conn.execute(
        "SELECT root_identities ->> %s FROM sources WHERE source_id = %s", (host(), source.source_id)).fetchone()[0]
    inside, roots = _neighbours(conn, source)
    crawl = Crawl(source, report, limits, known_root=known_root, nested=frozenset(inside), roots=roots,
                  skip_unsupported=skip_unsupported, known_stamp=_known_stamp(conn, source),
                  narrower_places=[(other, place(other.path)) for other in load_sources(conn)
                                   if other.source_id != source.source_id and not narrower(source, other)]
                  if source.allow_outside_links else [])
    with conn.transaction():
        known = _known_documents(conn, source.source_id)
        for folder, owned in sorted(inside.items()):
            _hand_over(conn, crawl, folder, owned, known)
        if source.kind == "web":
            found = walk_web(crawl, known, progress, conn)
        else:
            walk = {"folder": walk_folder, "objects": walk_objects, "table": walk_table}.get(source.kind)
            found = walk(crawl, known, progress) if walk else read_records(crawl, known, progress)
        batch: list[Found] = []
        held = 0  # bytes of the pages the batch holds (a web page's body travels with it to the database)
        for item in found:
            crawl.seen.add(item.locator)
            report.counts["seen"] += 1
            progress.advance()
            batch.append(item)
            held += len(item.body or b"")
            if len(batch) >= batch_size or held >= BATCH_BYTES:
                _write_batch(conn, crawl, batch, known)
                batch, held = [], 0
        if batch:
            _write_batch(conn, crawl, batch, known)
        for folder, owned in sorted(crawl.found.items()):
            _hand_over(conn, crawl, folder, owned, known)
        gone = _deletions(crawl, known, allow_deletions)
        # What served is marked, not deleted: the run's gated publish deletes it in the transaction that publishes
        # the rest. What never served (a file that failed) changes nothing that serves, and is forgotten now.
        conn.execute("SELECT kb_soft_delete_documents(%s, ARRAY(SELECT d.locator FROM documents d"
                     " WHERE d.source_id = %s AND d.locator = ANY(%s) AND d.deleted_at IS NULL AND NOT EXISTS"
                     " (SELECT 1 FROM chunks c WHERE c.document_id = d.document_id AND c.valid_to IS NULL)))",
                     (source.source_id, source.source_id, gone))
        conn.execute("UPDATE documents SET vanished_at = CASE WHEN locator = ANY(%(gone)s) THEN now() END"
                     " WHERE source_id = %(id)s AND deleted_at IS NULL"
                     " AND (vanished_at IS NOT NULL OR locator = ANY(%(gone)s))",
                     {"id": source.source_id, "gone": gone})
        report.counts["vanished"] += len(gone)
        for failure in (f for f in report.failures if f.source_id == source.source_id):
            record_failure(conn, failure, None)
        # A crawl failure that did not happen again is fixed (a record's line repaired, a file removed).
        conn.execute("DELETE FROM failures WHERE source_id = %s AND stage = %s AND NOT locator = ANY(%s)"
                     " AND NOT locator ^@ ANY(%s)", (source.source_id, STAGE, sorted(crawl.failed), crawl.unseen))
        summary = _summary(crawl, before, len(gone))
        report.notes.setdefault("sources", {})[source.source_id] = summary
        conn.execute("UPDATE sources SET last_crawled_at = now(), last_crawl = %s, root_identities = root_identities"
                     " || jsonb_build_object(%s::text, %s::text) WHERE source_id = %s",
                     (Jsonb(summary), host(), crawl.root_identity, source.source_id))
        conn.execute("UPDATE documents SET stale_since = NULL WHERE source_id = %s AND stale_since IS NOT NULL",
                     (source.source_id,))
        if source.kind == "jsonl":
            _record_stamp(conn, crawl)


# The stamp a JSONL source's next crawl may trust: none while the source has a failure (the crawl must see it again,
# or see it fixed), a record whose elements are not of its content or of this parser, or a record its last crawl
# found gone that no publish has deleted yet (the gate rolled it back, or the run died first): listing it as unchanged
# would bring it back.
KNOWN_STAMP = """
SELECT s.file_stamp FROM sources s
WHERE s.source_id = %(id)s
  AND NOT EXISTS (SELECT 1 FROM failures f WHERE f.source_id = s.source_id)
  AND NOT EXISTS (SELECT 1 FROM documents d WHERE d.source_id = s.source_id AND d.deleted_at IS NULL
                  AND (d.parsed_hash IS DISTINCT FROM d.content_hash OR d.parser_version IS DISTINCT FROM %(parser)s
                       OR d.vanished_at IS NOT NULL))
"""


def _known_stamp(conn: psycopg.Connection, source: Source) -> str | None:
    if source.kind != "jsonl":
        return None
    row = conn.execute(KNOWN_STAMP, {"id": source.source_id, "parser": PARSER_VERSION}).fetchone()
    return row[0] if row else None


def _record_stamp(conn: psycopg.Connection, crawl: Crawl) -> None:
    """The file's stamp with the live documents this crawl left, after a crawl that failed nowhere; else none."""
    stamp = None
    if crawl.stamp is not None and not crawl.failed and not crawl.blind:
        live = conn.execute("SELECT count(*) FROM documents WHERE source_id = %s AND deleted_at IS NULL",
                            (crawl.source.source_id,)).fetchone()[0]
        stamp = f"{crawl.stamp}:{live}"
    conn.execute("UPDATE sources SET file_stamp = %s WHERE source_id = %s", (stamp, crawl.source.source_id))


# How each kind knows a document unchanged without reading it (Found.content_hash None).
UNREAD_BY = {"folder": "size and mtime", "jsonl": "the file unchanged", "objects": "ETag", "web": "304 Not Modified",
             "table": "row version"}


def _summary(crawl: Crawl, before: Counter, deleted: int) -> dict:
    """What this crawl did to its source: the report's counts since it began, what it did not read and why."""
    done = {name: crawl.report.counts[name] - before[name] for name in ("seen", "new", "changed", "unchanged", "failed",
                                                                         "skipped")}
    read = done["new"] + done["changed"] + done["unchanged"] - crawl.unread
    return {"kind": crawl.source.kind, "listed": done["seen"], "read": read, "new": done["new"],
            "changed": done["changed"], "unchanged": done["unchanged"], "unread": crawl.unread,
            "unread_by": UNREAD_BY[crawl.source.kind], "failed": done["failed"], "skipped": done["skipped"],
            "deleted": deleted}


def extract(conn: psycopg.Connection, sources: list[Source], limits: Limits = Limits(),
            allow_deletions: bool = False, progress: Progress = NO_PROGRESS,
            accept_new_root: bool = False, skip_unsupported: bool = True) -> StageReport:
    report = StageReport(STAGE, ("seen", "new", "changed", "unchanged", "fetched", "vanished", "skipped"))
    for source in sources:
        try:
            crawl_source(conn, source, report, limits, allow_deletions, progress=progress,
                         accept_new_root=accept_new_root, skip_unsupported=skip_unsupported)
        except InsideNarrower as exc:  # nothing read, nothing deleted: the declarations must be put right
            _blind(conn, report, source, f"cannot crawl source: {exc.strerror}")
        except RootChanged as exc:  # nothing changed, nothing deleted, until the operator confirms the new root
            _blind(conn, report, source, f"cannot crawl source: {exc.strerror}. If the folder really moved there, run"
                                         f" `kb ingest --source {source.source_id} --accept-new-root`")
        # The source out of reach, or a JSONL file swapped for a link, a folder or a pipe: nothing changed or deleted.
        except (OSError, OutsideSource, NotARegularFile) as exc:
            _blind(conn, report, source, f"cannot crawl source: {exc}")
    return report.finish()


def _blind(conn: psycopg.Connection, report: StageReport, source: Source, reason: str) -> None:
    """A crawl that saw nothing: its failure is recorded, and what an earlier crawl found gone is no longer marked
    (this run's publish must not delete on what it did not see)."""
    failure = Failure(source.source_id, str(source.path), STAGE, reason)
    report.fail(failure)
    with conn.transaction():
        record_failure(conn, failure, None)
        summary = report.notes.setdefault("sources", {})[source.source_id] = {"kind": source.kind, "blind": True}
        conn.execute("UPDATE sources SET last_crawl = %s WHERE source_id = %s", (Jsonb(summary), source.source_id))
        conn.execute("UPDATE documents SET vanished_at = NULL WHERE source_id = %s AND vanished_at IS NOT NULL",
                     (source.source_id,))
