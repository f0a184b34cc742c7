"""The HTTP API (through FastAPI's test client, real database) and the console page in headless Chromium."""

import shutil
import subprocess
import threading
import time

import pytest
from fastapi.testclient import TestClient

from pipelines.ingest.run import ingest
from pipelines.models.embedders import make_embedder
from pipelines.serving.api import create_app
from pipelines.settings import SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare


@pytest.fixture
def ingested(conn, embedder):
    add_source(conn, declare("samples", SAMPLES_DIR / "docs"), "tests")
    ingest(conn, embedder, load_settings())


@pytest.fixture
def client(settings, ingested):
    with TestClient(create_app(settings)) as test_client:
        yield test_client


def test_search_returns_the_documented_shape(client):
    response = client.get("/v1/knowledge/search", params={"q": "fault code F-204"})
    assert response.status_code == 200
    body = response.json()
    assert set(body) == {"query", "k", "source_id", "mode", "arm", "chunks"}
    assert body["k"] == 5 and body["mode"] == "chunks" and len(body["chunks"]) == 5
    first = body["chunks"][0]
    assert {"content", "source", "score"} <= set(first) and "dense_rank" not in first
    assert "F-204" in first["content"]


def test_debug_shows_which_arm_found_each_chunk(client):
    chunks = client.get("/v1/knowledge/search", params={"q": "42P07", "debug": "true", "k": 3}).json()["chunks"]
    assert chunks[0]["lexical_rank"] == 1
    assert all("dense_rank" in c or "lexical_rank" in c for c in chunks)


def test_filter_by_source(client):
    body = client.get("/v1/knowledge/search", params={"q": "policy", "source_id": "nope"}).json()
    assert body["chunks"] == [] and body["source_id"] == "nope"


INVALID = [
    ("/v1/knowledge/search", {}),
    ("/v1/knowledge/search", {"q": ""}),
    ("/v1/knowledge/search", {"q": "x", "k": 21}),
    ("/v1/knowledge/search", {"q": "x", "k": 0}),
    ("/v1/knowledge/search", {"q": "x", "mode": "everything"}),
    ("/v1/knowledge/search", {"q": "x", "lexical_weight": 2}),
    ("/v1/knowledge/search", {"q": "x", "lexical_weight": "nan"}),
    ("/v1/knowledge/search", {"q": "x\x00y"}),
    ("/v1/knowledge/search", {"q": "x", "source_id": "samples\x00"}),
]


def test_invalid_requests_get_clear_4xx_errors(client):
    for path, params in INVALID:
        response = client.get(path, params=params)
        assert response.status_code == 422, (path, params, response.text)
        assert response.json()["detail"], (path, params)
    answer = client.post("/v1/knowledge/answer", json={"question": "parental leave\x00"})
    assert answer.status_code == 422 and "NUL" in answer.json()["detail"]


def test_health_says_whether_the_database_answers(settings, client, server_url):
    import psycopg

    healthy = client.get("/health")
    assert healthy.status_code == 200 and healthy.json()["status"] == "ok" and healthy.json()["version"]
    with psycopg.connect(server_url, autocommit=True) as admin:  # the database goes away under the server
        admin.execute(f"DROP DATABASE {psycopg.conninfo.conninfo_to_dict(settings.database_url)['dbname']} WITH (FORCE)")
    down = client.get("/health")
    assert down.status_code == 503 and down.json()["status"] == "unavailable"
    # /health needs no key: it tells an anonymous caller the database is down, not where it lives or who logs in
    server = psycopg.conninfo.conninfo_to_dict(settings.database_url)
    for detail in (server["dbname"], server.get("host") or "", server.get("user") or ""):
        assert not detail or detail not in down.text, down.text


def test_openapi_documents_the_endpoint(client):
    spec = client.get("/openapi.json").json()
    params = {p["name"] for p in spec["paths"]["/v1/knowledge/search"]["get"]["parameters"]}
    assert {"q", "k", "source_id", "mode", "debug"} <= params


def test_empty_knowledge_base_is_a_409(settings):
    with TestClient(create_app(settings)) as empty:
        response = empty.get("/v1/knowledge/search", params={"q": "anything"})
    assert response.status_code == 409 and "kb ingest" in response.json()["detail"]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def console_dom(settings, url_path: str) -> str:
    """The console page as headless Chromium renders it, against a live server on a free port."""
    import uvicorn

    assert CHROMIUM, "headless Chromium is required (make test installs Debian's chromium)"
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        return subprocess.run(
            # No network: every name fails to resolve and anything not on loopback goes to a dead proxy.
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1", "--proxy-server=127.0.0.1:9",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--virtual-time-budget=10000",
             "--dump-dom", f"http://127.0.0.1:{port}{url_path}"],
            capture_output=True, text=True, timeout=90, check=True).stdout
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_console_explains_the_ranking_and_highlights_matches(settings, ingested):
    dom = console_dom(settings, "/?q=What%20does%20error%2042P07%20mean%3F")
    assert dom.count('class="hit"') == 5
    assert "samples:ops/postgres-runbook.txt" in dom
    assert "identifier query" in dom and "lexical weight 0.7" in dom and "42P07: a code in few readable chunks" in dom
    assert "lexical (BM25) #1" in dom and "dense #" in dom and "RRF +" in dom
    assert "<mark>42P07</mark>" in dom and "holds 42P07" in dom
    for control in ('id="source"', 'id="arm"', 'id="weight"', 'id="asof"', 'id="groups"', 'id="exact"'):
        assert control in dom  # the console offers the CLI's filters


def test_api_docs_render_offline(settings, ingested):
    dom = console_dom(settings, "/docs")
    assert "/static/swagger/swagger-ui-bundle.js" in dom and "cdn" not in dom.lower()
    assert 'class="swagger-ui"' in dom and "/v1/knowledge/search" in dom  # rendered by Swagger UI itself
    assert "kb search API" in dom


def test_console_reads_with_the_key_it_is_given(settings, conn, ingested):
    from pipelines.serving.access import create_key

    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl", groups=["staff"]), "tests")
    ingest(conn, make_embedder(settings), settings, ["faq"])
    _, token = create_key(conn, "console", ["staff"], "tests")
    query = "/?q=How%20do%20I%20reset%20my%20VPN%20token%3F"
    assert "faq:faq-001" not in console_dom(settings, query)
    with_key = console_dom(settings, query + f"#key={token}")
    assert "faq:faq-001" in with_key and "reading with your key" in with_key
    assert "needs a valid API key" in console_dom(settings, query + "#key=kb_0000_wrong")


def test_citations_are_valid_weak_or_invalid(client):
    hits = client.get("/v1/knowledge/search", params={"q": "primary caregiver paid leave weeks", "k": 5, "debug": True}).json()["chunks"]
    other = client.get("/v1/knowledge/search", params={"q": "DC bus overvoltage fault code", "k": 1}).json()["chunks"]
    retrieved = [h["chunk_id"] for h in hits + other]
    supporting, unrelated = hits[0]["chunk_id"], other[0]["chunk_id"]
    body = {"retrieved": retrieved, "claims": [
        {"text": "A primary caregiver gets 20 weeks of leave at full base pay.", "citations": [supporting]},
        {"text": "A primary caregiver gets 20 weeks of leave at full base pay.", "citations": [unrelated]},
        {"text": "The AVX-039 fan must be replaced every 30,000 hours.", "citations": [999999]},
    ]}
    result = client.post("/v1/citations/validate", json=body).json()
    assert [c["status"] for c in result["citations"]] == ["VALID", "WEAK", "INVALID"]
    assert result["summary"] == {"VALID": 1, "WEAK": 1, "INVALID": 1}
    assert client.post("/v1/citations/validate", json={"claims": "nope"}).status_code == 422
