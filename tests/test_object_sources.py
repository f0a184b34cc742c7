"""Buckets as sources (issue 28, item 1), against a real S3 API: moto's server on loopback, spoken to over HTTP by
s3fs as it would speak to AWS. Each test makes its own bucket; the server's request log says what kb asked for."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from pipelines.cli import main
from pipelines.ingest.flow import stage
from pipelines.ingest.run import IngestRun
from pipelines.retrieval.search import Filters, search
from pipelines.sources.objects import list_objects

SECRET_KEY = "kb-test-secret-Zq8vXw"  # must never be stored or printed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    def __init__(self, log: Path, **env: str) -> None:
        self.log, self.port = log, _free_port()
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=log.open("wb"), env={"PATH": "/usr/bin:/bin", **env})
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120  # a loaded machine starts it slowly; a dead one fails here, not later
        while True:
            try:
                httpx.get(self.url, timeout=5)
                return
            except httpx.TransportError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)

    def requests(self) -> list[str]:
        """The request lines served so far ("GET /bucket/key ...")."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text())  # werkzeug colours some lines
        return [line.split('"')[1] for line in text.splitlines() if line.count('"') >= 2]

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("moto") / "requests.log")
    yield server
    server.stop()


@pytest.fixture
def bucket(s3, monkeypatch):
    """A fresh bucket on the server, with the environment kb's S3 client reads its endpoint and credentials from."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "kbtest")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import boto3

    client = boto3.client("s3")
    name = f"kb-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    return name, client


def kb(*args: str, expect: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    assert SECRET_KEY not in result.output
    return result.output if expect == 2 else result.stdout  # a usage error's line is on stderr


def ingest(*args: str, expect: int = 0) -> dict:
    return json.loads(kb("ingest", *args, "--json", expect=expect))


def texts(conn, embedder, query: str, groups=(), as_of=None) -> list[tuple[str, str]]:
    hits = search(conn, embedder, query, 10, filters=Filters(groups=list(groups), as_of=as_of))
    return [(h.document, h.content) for h in hits]


def put(client, bucket: str, key: str, text: str) -> None:
    client.put_object(Bucket=bucket, Key=key, Body=text.encode())


def test_a_bucket_is_ingested_and_a_refresh_downloads_only_what_changed(settings, conn, embedder, bucket, s3):
    name, client = bucket
    put(client, name, "docs/leave.md", "# Parental leave\n\nA primary caregiver gets sixteen weeks of paid leave.\n")
    put(client, name, "docs/travel/policy.txt", "Travel: economy class for flights under six hours.\n")
    put(client, name, "docs/site/faq.html", "<html><body><h1>Parking</h1><p>The okapi garage opens at seven.</p>"
                                            "</body></html>")
    put(client, name, "docs/photo.jpg", "not a document")
    put(client, name, "elsewhere.md", "# Outside the prefix\n\nNever read.\n")
    kb("source", "add", "bucket", f"s3://{name}/docs/", "--public")

    first = ingest()
    assert (first["documents_new"], first["documents_fetched"], first["errors"]) == (3, 3, [])
    assert [s["file"] for s in first["skipped"]] == ["photo.jpg"]
    assert any("sixteen weeks" in c for _, c in texts(conn, embedder, "paid leave for a primary caregiver"))
    assert ("site/faq.html", ) == tuple({d for d, c in texts(conn, embedder, "okapi garage") if "okapi" in c})
    assert conn.execute("SELECT location FROM sources WHERE source_id = 'bucket'").fetchone()[0] == f"s3://{name}/docs"

    served = len(s3.requests())
    again = ingest("--source", "bucket")
    asked = s3.requests()[served:]
    assert (again["documents_unchanged"], again["documents_fetched"]) == (3, 0)
    assert "  bucket: 3 listed, 0 fetched, 3 unchanged (3 not read: ETag), 0 failed, 0 deleted" in kb("ingest")
    assert asked and all(line.startswith(f"GET /{name}?") or line.startswith(f"HEAD /{name}") for line in asked), asked

    put(client, name, "docs/leave.md", "# Parental leave\n\nA primary caregiver gets twenty weeks of paid leave.\n")
    client.delete_object(Bucket=name, Key="docs/travel/policy.txt")  # a delete marker: the key is gone
    before = conn.execute("SELECT clock_timestamp()").fetchone()[0]
    served = len(s3.requests())
    changed = ingest("--source", "bucket", "--allow-deletions")  # 1 of 3 deleted is within the share; said anyway
    reads = [line for line in s3.requests()[served:] if line.startswith(f"GET /{name}/")]
    assert (changed["documents_changed"], changed["documents_fetched"], changed["documents_deleted"]) == (1, 1, 1)
    assert "last crawl: 2 listed, 1 fetched, 1 unchanged (1 not read: ETag), 0 failed, 1 deleted" in kb("status")
    assert {line.split()[1].split("?")[0] for line in reads} == {f"/{name}/docs/leave.md"}  # crawl, then parse
    now = texts(conn, embedder, "paid leave for a primary caregiver")
    assert any("twenty weeks" in c for _, c in now) and not any("sixteen" in c for _, c in now)
    assert not any("economy class" in c for _, c in texts(conn, embedder, "travel flights economy class"))
    then = texts(conn, embedder, "travel flights economy class", as_of=before)
    assert any("economy class" in c for _, c in then), "the deleted object's history is kept"


def test_an_object_replaced_during_the_run_is_read_again_by_the_next(settings, conn, embedder, bucket):
    name, client = bucket
    put(client, name, "a.md", "# Canteen\n\nThe canteen serves okapi stew on Fridays.\n")
    kb("source", "add", "bucket", f"s3://{name}", "--public")
    with IngestRun.open(conn, settings, embedder, ["bucket"]) as run:
        run.run_stage(stage("extract"))
        put(client, name, "a.md", "# Canteen\n\nThe canteen serves zebra curry on Fridays.\n")
        for name_ in ("parse", "chunk", "enrich", "embed", "publish"):
            run.run_stage(stage(name_))
    failures = conn.execute("SELECT locator, reason FROM failures WHERE source_id = 'bucket'").fetchall()
    assert failures == [("a.md", "s3://%s/a.md: the file changed after this run crawled it; the next run reads it"
                                 " again" % name)]
    assert not texts(conn, embedder, "canteen Fridays")  # nothing half-read was served
    ingest("--source", "bucket")
    assert any("zebra curry" in c for _, c in texts(conn, embedder, "canteen Fridays"))
    assert conn.execute("SELECT count(*) FROM failures WHERE source_id = 'bucket'").fetchone()[0] == 0


def test_a_listing_that_fails_deletes_nothing_and_says_so_in_one_line(settings, conn, embedder, bucket, tmp_path,
                                                                      monkeypatch):
    name, client = bucket
    put(client, name, "a.md", "# Canteen\n\nThe canteen serves okapi stew on Fridays.\n")
    kb("source", "add", "bucket", f"s3://{name}", "--public")
    ingest()

    locked = S3Server(tmp_path / "locked.log", INITIAL_NO_AUTH_ACTION_COUNT="0")  # checks credentials: ours are unknown
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", locked.url)
        forbidden = ingest("--source", "bucket", expect=3)
    finally:
        locked.stop()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens: no network
    unreachable = ingest("--source", "bucket", expect=3)
    for result, why in ((forbidden, "PermissionError"), (unreachable, "EndpointConnectionError")):
        assert [(e["source"], e["file"]) for e in result["errors"]] == [("bucket", f"s3://{name}")], result
        assert f"cannot list s3://{name}" in result["errors"][0]["reason"] and why in result["errors"][0]["reason"]
        assert result["documents_deleted"] == 0
    assert any("okapi" in c for _, c in texts(conn, embedder, "canteen Fridays")), "a failed listing deleted nothing"
    assert "last crawl: saw nothing: the source could not be read (see failing)" in kb("status")


def test_a_missing_bucket_is_a_failed_crawl_not_an_empty_one(settings, conn, embedder, bucket):
    name, client = bucket
    put(client, name, "a.md", "# Canteen\n\nThe canteen serves okapi stew on Fridays.\n")
    kb("source", "add", "bucket", f"s3://{name}", "--public", "--max-deletion-share", "1")
    ingest()
    for version in client.list_object_versions(Bucket=name).get("Versions", []):
        client.delete_object(Bucket=name, Key=version["Key"], VersionId=version["VersionId"])
    client.delete_bucket(Bucket=name)
    result = ingest("--source", "bucket", "--allow-deletions", expect=3)
    assert "does not exist" in result["errors"][0]["reason"] and result["documents_deleted"] == 0
    assert any("okapi" in c for _, c in texts(conn, embedder, "canteen Fridays"))


def test_a_listing_of_more_than_ten_thousand_keys_is_read_to_its_last_page(bucket):
    from concurrent.futures import ThreadPoolExecutor

    name, client = bucket
    keys = [f"p/{i:05d}.bin" for i in range(10_001)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda key: client.put_object(Bucket=name, Key=key, Body=b"x"), keys))
    listed = list(list_objects(f"s3://{name}/p"))
    assert [o.key for o in listed] == [k.removeprefix("p/") for k in keys]  # 11 pages of at most 1,000
    assert len({o.tag for o in listed}) == 1  # one content, one ETag


def test_a_restricted_prefix_inside_a_public_bucket_is_read_only_by_its_groups(settings, conn, embedder, bucket):
    name, client = bucket
    put(client, name, "canteen.md", "# Canteen\n\nThe canteen serves okapi stew on Fridays.\n")
    put(client, name, "hr/bonus.md", "# Bonus\n\nThe zebra bonus pool for directors is confidential.\n")
    kb("source", "add", "pub", f"s3://{name}", "--public")
    ingest()
    assert any("zebra" in c for _, c in texts(conn, embedder, "zebra bonus pool directors"))
    kb("source", "add", "hr", f"s3a://{name}/hr", "--group", "hr")  # another name for the same bucket
    ingest()
    assert not any("zebra" in c for _, c in texts(conn, embedder, "zebra bonus pool directors"))
    assert not any("zebra" in c for _, c in texts(conn, embedder, "zebra bonus pool directors",
                                                  as_of=conn.execute("SELECT now()").fetchone()[0]))
    assert [d for d, c in texts(conn, embedder, "zebra bonus pool directors", ["hr"]) if "zebra" in c] == ["bonus.md"]
    refused = kb("source", "add", "open", f"s3://{name}/hr/", "--public", expect=2)
    assert "is the location of source 'hr'" in refused


def test_declarations_of_buckets_refuse_credentials_and_a_missing_bucket_name(settings):
    leaked = kb("source", "add", "b", f"s3://AKIA:{SECRET_KEY}@bucket/docs", "--public", expect=2)
    assert "credentials and options come from the environment" in leaked
    nobucket = kb("source", "add", "n", "s3:///docs", "--public", expect=2)
    assert "name the bucket" in nobucket
    for elsewhere in ("local:///etc", "file:///etc", "ftp://10.0.0.1/pub", "memory://x/y"):
        refused = kb("source", "add", "x", elsewhere, "--public", expect=2)
        assert "is not a bucket kb reads" in refused, elsewhere
