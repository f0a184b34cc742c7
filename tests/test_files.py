"""No file outside a source is ever read (issue 18): files opened once, below the source root's own descriptor,
without following links; a replaced root refused; loops, pipes and poison files cost one path, once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.sources.files import NotARegularFile, OutsideSource, open_below, open_root, read_below

KB = str(Path(sys.executable).parent / "kb")
SECRET = "root:$6$salt$zebra-secret-hash:19000:0:99999:7:::"


def kb(*args: str, expect: int | None = 0) -> subprocess.CompletedProcess:
    out = subprocess.run([KB, *args], capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    if expect is not None:
        assert out.returncode == expect, out.stdout + out.stderr
    return out


def searchable(text: str) -> bool:
    hits = json.loads(kb("search", text, "--k", "10", "--json").stdout)["chunks"]
    return any("zebra-secret-hash" in hit["content"] for hit in hits)


@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "private" / "shadow"
    path.parent.mkdir()
    path.write_text(SECRET + "\n")
    return path


def _flip(race: Path, regular: Path, secret: Path, swaps, stop) -> None:
    """A hostile writer: swaps `race` between a regular file and a link to the secret with rename(2), forever."""
    while not stop.is_set():
        (race.parent.parent / "file").write_bytes(regular.read_bytes())
        os.replace(race.parent.parent / "file", race)
        (race.parent.parent / "link").symlink_to(secret)
        os.replace(race.parent.parent / "link", race)
        with swaps.get_lock():
            swaps.value += 2


def test_a_file_swapped_for_a_link_while_it_is_read_never_yields_the_link_target(tmp_path, secret):
    """A writer process flips race.txt between a regular file and a link to a secret while the reader reads it
    until a thousand swaps have happened: the reader gets the file or a refusal, never the secret. (Checking the path
    and opening it again by name, as kb did, leaked the secret 12 times in 3,000 reads here.)"""
    import multiprocessing
    import time

    root = tmp_path / "docs"
    root.mkdir()
    race, regular = root / "race.txt", tmp_path / "regular.txt"
    regular.write_text("An ordinary note.\n")
    race.write_bytes(regular.read_bytes())
    context = multiprocessing.get_context("fork")
    swaps, stop = context.Value("i", 0), context.Event()
    writer = context.Process(target=_flip, args=(race, regular, secret, swaps, stop), daemon=True)
    writer.start()
    deadline = time.monotonic() + 300  # a guard only: the loop ends on the number of swaps
    try:
        while swaps.value < 1000 and time.monotonic() < deadline and writer.is_alive():
            try:
                data = read_below(root, None, "race.txt", False, 1e6)
            except (OutsideSource, FileNotFoundError):
                continue
            assert SECRET.encode() not in data
    finally:
        stop.set()
        writer.join(timeout=30)
    assert swaps.value >= 1000, "the writer did not swap the file often enough to test anything"


def test_links_pipes_and_loops_are_refused_below_the_root(tmp_path, secret):
    root = tmp_path / "docs"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "note.md").write_text("# Note\n")
    (root / "link.md").symlink_to(secret)
    (root / "linked-dir").symlink_to(root / "sub", target_is_directory=True)
    (root / "loop-a").symlink_to(root / "loop-b")
    (root / "loop-b").symlink_to(root / "loop-a")
    os.mkfifo(root / "pipe.txt")
    with open_root(root, None) as fd:
        os.close(open_below(fd, "sub/note.md", root))
        for relpath in ("link.md", "linked-dir/note.md", "loop-a", "../private/shadow"):
            with pytest.raises(OutsideSource):
                open_below(fd, relpath, root)
        with pytest.raises(NotARegularFile):  # a named pipe is refused at once; reading it would hang the run
            open_below(fd, "pipe.txt", root)
        with pytest.raises(OSError):  # followed on request, a loop is still an error of that path
            open_below(fd, "loop-a", root, follow_links=True)


def test_a_source_root_replaced_by_a_link_reads_and_deletes_nothing(settings, tmp_path, secret):
    share = tmp_path / "share"
    docs = share / "docs"
    docs.mkdir(parents=True)
    (docs / "handbook.md").write_text("# Handbook\n\nThe okapi handbook.\n")
    kb("ingest", str(docs), "--source", "share", "--public")
    private = secret.parent
    (private / "payroll.md").write_text(f"# Payroll\n\n{SECRET}\n")
    (share / "docs").rename(share / "docs.old")
    (share / "docs").symlink_to(private, target_is_directory=True)
    out = kb("ingest", "--source", "share", "--json", expect=3)
    data = json.loads(out.stdout)
    assert data["documents_deleted"] == 0 and data["documents_new"] == 0
    assert "is not the folder kb crawled before" in data["errors"][0]["reason"]
    assert "--accept-new-root" in data["errors"][0]["reason"]
    assert not searchable("payroll zebra secret hash")
    assert json.loads(kb("status", "--json").stdout)["sources"][0]["documents"] == 1  # the handbook still serves


def test_a_symlink_loop_or_a_pipe_is_one_failed_path_and_the_run_goes_on(settings, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "handbook.md").write_text("# Handbook\n\nThe okapi handbook.\n")
    (docs / "loop-a").symlink_to(docs / "loop-b")
    (docs / "loop-b").symlink_to(docs / "loop-a")
    os.mkfifo(docs / "pipe.txt")
    data = json.loads(kb("ingest", str(docs), "--source", "docs", "--public", "--json", expect=3).stdout)
    reasons = {e["file"]: e["reason"] for e in data["errors"]}
    assert set(reasons) == {"loop-a", "loop-b", "pipe.txt"}
    assert "symbolic link" in reasons["loop-a"] and "not a regular file" in reasons["pipe.txt"]
    assert data["documents_published"] == 1


def test_an_unchanged_poison_file_is_reported_not_parsed_again_until_asked(settings, tmp_path):
    import zipfile

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "note.md").write_text("# Note\n\nAn okapi note.\n")
    with zipfile.ZipFile(docs / "bomb.docx", "w", zipfile.ZIP_DEFLATED) as bomb:
        bomb.writestr("word/document.xml", b"<w:t>" + b"0" * 30_000_000 + b"</w:t>")
    env_limit = {"KB_MAX_UNZIPPED_MB": "10"}
    os.environ.update(env_limit)
    try:
        first = json.loads(kb("ingest", str(docs), "--source", "docs", "--public", "--json", expect=3).stdout)
        assert "expands to 30 MB" in first["errors"][0]["reason"]
        again = json.loads(kb("ingest", "--source", "docs", "--json", expect=3).stdout)
        assert [e["file"] for e in again["errors"]] == ["bomb.docx"]
        assert "not parsed again" in again["errors"][0]["reason"] and "expands to 30 MB" in again["errors"][0]["reason"]
        retried = json.loads(kb("ingest", "--source", "docs", "--retry-failed", "--json", expect=3).stdout)
        assert "expands to 30 MB" in retried["errors"][0]["reason"]
        assert "not parsed again" not in retried["errors"][0]["reason"]
    finally:
        for name in env_limit:
            os.environ.pop(name)


def test_a_long_paragraph_of_plain_text_parses_in_bounded_memory(conn, settings, tmp_path):
    """229 KB of one paragraph took unstructured's text partitioner 1.3 GB; kb splits plain text itself."""
    from pipelines.ingest.extract import extract
    from pipelines.ingest.parse import parse_pending
    from pipelines.settings import Limits
    from pipelines.sources.declarations import add_source, declare, load_sources

    docs = tmp_path / "docs"
    docs.mkdir()
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    (docs / "one-paragraph.txt").write_text(" ".join(words[i % 8] + str(i % 97) for i in range(40_000)) + ".\n")
    (docs / "service-log.txt").write_text("\n".join(f"2026-12-01T10:{i % 60:02d}:00 INFO request {i} served"
                                                for i in range(20_000)))
    add_source(conn, declare("docs", docs), "tests")
    extract(conn, load_sources(conn, ["docs"]), settings.limits)
    report = parse_pending(conn, ["docs"], limits=Limits(parse_memory_mb=400))
    assert report.failures == [] and report.counts["parsed"] == 2


def test_only_regular_files_of_an_unsupported_type_are_skipped(settings, tmp_path):
    """A link or a pipe is a failure whatever its name; a regular .bin file is skipped, never opened."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "handbook.md").write_text("# Handbook\n\nThe okapi handbook.\n")
    (docs / "firmware.bin").write_bytes(b"\x00" * 10)
    (docs / "link.bin").symlink_to(docs / "firmware.bin")
    os.mkfifo(docs / "pipe.bin")
    data = json.loads(kb("ingest", str(docs), "--source", "docs", "--public", "--json", expect=3).stdout)
    assert [s["file"] for s in data["skipped"]] == ["firmware.bin"]
    assert {e["file"] for e in data["errors"]} == {"link.bin", "pipe.bin"}


def _nest(root: Path, depth: int, files: dict[int, str]) -> None:
    """Folders d/d/d/... `depth` deep below `root`, with a file at the levels in `files`. Made through descriptors
    (os.makedirs recurses in Python and would itself stop at about 1,000 levels)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for level in range(1, depth + 1):
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
            if level in files:
                note = os.open(files[level], os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
                os.write(note, f"# Level {level}\n\nA note about okapis, {level} folders down.\n".encode())
                os.close(note)
    finally:
        os.close(fd)


def _unnest(root: Path) -> None:
    """Remove what `_nest` made, from the top, each level moved up before its parent goes (shutil.rmtree, and so
    pytest's cleanup, recurse in Python)."""
    while (root / "d").exists():
        os.rename(root / "d", root / "gone")
        for name in os.listdir(root / "gone"):
            if name == "d":
                os.rename(root / "gone" / "d", root / "d")
            else:
                os.unlink(root / "gone" / name)
        os.rmdir(root / "gone")


@pytest.fixture
def deep_docs(tmp_path) -> Path:
    """docs/handbook.md beside a folder nested 1,100 deep, with a note 10 levels down and one at the bottom."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "handbook.md").write_text("# Handbook\n\nThe okapi handbook.\n")
    _nest(docs, 1100, {10: "shallow.md", 1100: "bottom.md"})
    yield docs
    _unnest(docs)


def test_a_folder_nested_1100_deep_is_one_failure_and_the_run_goes_on(conn, embedder, settings, tmp_path, deep_docs):
    """Issue 27 item 9: the walk recursed in Python (os.fwalk) and a folder 1,100 deep stopped the whole run with
    RecursionError: no source ingested anything. Now the folder past the depth limit is one failure."""
    from pipelines.ingest.run import ingest
    from pipelines.sources.declarations import add_source, declare
    from pipelines.sources.files import MAX_FOLDER_DEPTH

    other = tmp_path / "other"
    other.mkdir()
    (other / "memo.md").write_text("# Memo\n\nThe zebra memo.\n")
    add_source(conn, declare("deep", deep_docs), "tests")
    add_source(conn, declare("other", other), "tests")
    summary = ingest(conn, embedder, settings)
    too_deep = "d/" * (MAX_FOLDER_DEPTH + 1)
    assert [(f.source_id, f.locator, f.reason) for f in summary.failures] == [("deep", too_deep, (
        f"cannot read folder {deep_docs / too_deep.rstrip('/')}: nested deeper than {MAX_FOLDER_DEPTH} levels;"
        " its files were not read; documents stored under it are kept"))]
    published = conn.execute("SELECT source_id, locator FROM documents WHERE published_key IS NOT NULL").fetchall()
    assert sorted(published) == [("deep", "d/" * 10 + "shallow.md"), ("deep", "handbook.md"), ("other", "memo.md")]
    assert conn.execute("SELECT locator FROM failures").fetchall() == [(too_deep,)]


def test_the_walk_keeps_few_descriptors_open_however_deep_the_tree(deep_docs):
    """Each folder is opened below its parent's descriptor; only the folders from the root down to the one being
    listed are open, and the depth limit bounds them (not the tree's 1,100 levels)."""
    from pipelines.sources.files import MAX_FOLDER_DEPTH, walk_below

    def open_descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    before, most, refused = open_descriptors(), 0, []
    with open_root(deep_docs, None) as root_fd:
        for dirpath, dirnames, filenames, dir_fd in walk_below(root_fd, onerror=refused.append):
            most = max(most, open_descriptors())
            assert os.path.samestat(os.fstat(dir_fd), os.stat(deep_docs / dirpath))
    assert open_descriptors() == before
    assert most <= before + MAX_FOLDER_DEPTH + 2
    assert [(e.filename, e.strerror) for e in refused] == [
        ("d/" * MAX_FOLDER_DEPTH + "d", f"nested deeper than {MAX_FOLDER_DEPTH} levels; its files were not read")]


def test_documents_below_a_folder_past_the_depth_limit_are_kept(conn, embedder, settings, tmp_path, monkeypatch):
    """A folder the walk does not enter is like an unreadable one: what was stored under it stays live. Hidden
    folders are skipped before their depth counts."""
    from pipelines.ingest.run import ingest
    from pipelines.sources import files
    from pipelines.sources.declarations import add_source, declare

    docs = tmp_path / "docs"
    (docs / "a" / "b" / "c" / "d").mkdir(parents=True)
    (docs / ".git" / "a" / "b" / "c" / "d").mkdir(parents=True)
    (docs / ".git" / "a" / "b" / "c" / "d" / "HEAD.md").write_text("# Not a document\n")
    for relpath in ("top.md", "a/side.md", "a/b/c/d/deep.md"):
        (docs / relpath).write_text(f"# {relpath}\n\nAn okapi note in {relpath}.\n")
    add_source(conn, declare("docs", docs), "tests")
    assert ingest(conn, embedder, settings).counters()["documents_published"] == 3
    monkeypatch.setattr(files, "MAX_FOLDER_DEPTH", 3)
    summary = ingest(conn, embedder, settings)
    assert [(f.locator, f.reason.split(": ", 1)[1]) for f in summary.failures] == [
        ("a/b/c/d/", "nested deeper than 3 levels; its files were not read; documents stored under it are kept")]
    assert summary.counters()["documents_deleted"] == 0
    live = conn.execute("SELECT locator FROM documents WHERE deleted_at IS NULL ORDER BY 1").fetchall()
    assert [r[0] for r in live] == ["a/b/c/d/deep.md", "a/side.md", "top.md"]
