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
from pipelines.serving.bounds import BODY_BYTES, MAX_CLAIMS, Limits
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
    body = client.get("/v1/knowledge/search", params={"q": "policy", "source_id": "samples"}).json()
    assert body["chunks"] and {c["source"] for c in body["chunks"]} == {"samples"}
    unknown = client.get("/v1/knowledge/search", params={"q": "policy", "source_id": "nope"})
    assert unknown.status_code == 404 and unknown.json()["detail"] == ("no source 'nope' that this caller may read;"
                                                                       " GET /v1/sources lists them")


INVALID = [
    ("/v1/knowledge/search", {}),
    ("/v1/knowledge/search", {"q": ""}),
    ("/v1/knowledge/search", {"q": "x", "k": 101}),
    ("/v1/knowledge/search", {"q": "x" * 2001}),
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


def test_empty_knowledge_base_is_a_409(settings, conn):  # conn: installed, as any kb command would (serving never does)
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
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the API server did not start"
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


def within(seconds: float, call):
    """call() on a thread; fails the test (instead of hanging it) when it does not return in time."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert result, f"no answer within {seconds} s"
    return result[0]


def test_requests_over_a_bound_are_refused_before_any_work(client):
    """Issue 18 (a): size bounds, tripped by size. 20,000 claims once cost 100 s of CPU; now a body over 1 MiB is
    a 413 whether it declares its length or streams it, and each field over its limit a one-line 422."""
    big = {"claims": [], "retrieved": list(range(200_000))}  # about 1.3 MB, cheap for the old code to accept
    response = client.post("/v1/citations/validate", json=big)
    assert response.status_code == 413 and f"at most {BODY_BYTES} bytes" in response.json()["detail"]
    streamed = client.post("/v1/citations/validate", headers={"Content-Type": "application/json"},
                           content=iter([b'{"claims": [], "retrieved": [' + b"1," * 600_000, b"1]}"]))
    assert streamed.status_code == 413
    claim = {"text": "A primary caregiver gets 20 weeks of leave.", "citations": [1]}
    for body, field, limit in (({"claims": [claim] * (MAX_CLAIMS + 1), "retrieved": [1]}, "claims", "200 items"),
                               ({"claims": [{**claim, "text": "x" * 8001}], "retrieved": [1]}, "text", "8000 char")):
        response = client.post("/v1/citations/validate", json=body)
        detail = response.json()["detail"]
        assert response.status_code == 422 and field in detail and limit in detail and "\n" not in detail, detail
    detail = client.get("/v1/knowledge/search", params={"q": "x", "k": 101}).json()["detail"]
    assert detail == "query.k: Input should be less than or equal to 100"
    assert client.get("/v1/knowledge/search", params={"q": "leave", "k": 100}).status_code == 200  # as kb search


def test_a_flood_of_citation_checks_cannot_starve_search_or_health(client, monkeypatch):
    """Issue 18 (a): 10 citation checks held inside the server (a hook pauses the real validator) once took all 8
    pooled connections, so searches waited 30 s and failed and /health said the database was down. Now the
    citations lane holds them: the ones it has no room for are a prompt 503, search and /health answer."""
    from pipelines.answers import citations

    real, release, entered = citations.validate_citations, threading.Event(), threading.Semaphore(0)

    def held(*args, **kwargs):
        entered.release()
        assert release.wait(60), "never released"
        return real(*args, **kwargs)

    monkeypatch.setattr(citations, "validate_citations", held)
    body = {"claims": [{"text": "Leave is 20 weeks.", "citations": [1]}], "retrieved": [1]}
    responses: list = []
    posts = [threading.Thread(target=lambda: responses.append(client.post("/v1/citations/validate", json=body)))
             for _ in range(10)]
    try:
        for post in posts:
            post.start()
        deadline = time.monotonic() + 30
        while len(responses) < 8 and time.monotonic() < deadline:  # the lane's 2 slots hold, 8 are turned away
            time.sleep(0.05)
        assert len(responses) == 8, f"{len(responses)} of the 8 requests beyond the citations lane were answered"
        assert all(r.status_code == 503 and "busy, retry" in r.json()["detail"] for r in responses)
        assert entered.acquire(timeout=60) and entered.acquire(timeout=60) and not entered.acquire(timeout=0)
        search = within(10, lambda: client.get("/v1/knowledge/search", params={"q": "parental leave"}))
        assert search.status_code == 200 and search.json()["chunks"]
        health = within(10, lambda: client.get("/health"))
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        release.set()
        for post in posts:
            post.join(60)
    assert [r.status_code for r in responses[8:]] == [200, 200]


def test_a_statement_over_the_time_budget_is_a_503(settings, ingested, conn):
    """The per-request budget, tripped by a held lock rather than by a slow machine: the search waits on it, the
    database cancels the statement at the budget, the caller gets a 503 that says so."""
    with TestClient(create_app(settings, limits=Limits(budget_s=0.2))) as fast:
        with conn.transaction():
            conn.execute("LOCK TABLE embedding_models IN ACCESS EXCLUSIVE MODE")
            response = within(30, lambda: fast.get("/v1/knowledge/search", params={"q": "leave"}))
        assert response.status_code == 503 and "time budget" in response.json()["detail"]
        assert fast.get("/v1/knowledge/search", params={"q": "leave"}).status_code == 200  # the lane recovers


def test_a_malformed_authorization_header_is_a_401(client):
    """Issue 18 (b): a caller that sent credentials is never served as anonymous."""
    for authorization in ("Basic dXNlcjpwYXNzd29yZA==", "Bearer", "Bearer  ", "Token kb_x_y", "kb_x_y"):
        response = client.get("/v1/knowledge/search", params={"q": "leave"}, headers={"Authorization": authorization})
        assert response.status_code == 401 and "Bearer <key>" in response.json()["detail"], authorization
        assert response.headers["WWW-Authenticate"] == "Bearer"


def test_an_empty_key_header_or_more_than_one_credential_is_a_401(client, conn):
    """Issue 27 (6): a request carries one credential. Two X-API-Key headers, two Authorization headers (Bearer
    then Basic), or an Authorization with an X-API-Key, even holding the same key, is a 401 with one line: the
    first one no longer wins, so a proxy's header cannot be shadowed by (or shadow) the caller's."""
    from pipelines.serving.access import create_key

    _, token = create_key(conn, "reader", [], "tests")
    assert client.get("/v1/knowledge/search", params={"q": "leave"}, headers={"X-API-Key": ""}).status_code == 401
    for headers in ([("X-API-Key", token), ("Authorization", "Bearer kb_other_key")],
                    [("X-API-Key", token), ("Authorization", f"Bearer {token}")],
                    [("X-API-Key", token), ("X-API-Key", "kb_other_key")],
                    [("X-API-Key", token), ("X-API-Key", token)],
                    [("x-api-key", token), ("X-Api-Key", "")],
                    [("Authorization", f"Bearer {token}"), ("Authorization", "Basic dXNlcjpwYXNzd29yZA==")],
                    [("Authorization", f"Bearer {token}"), ("authorization", f"Bearer {token}")]):
        response = client.get("/v1/knowledge/search", params={"q": "leave"}, headers=headers)
        assert response.status_code == 401, (headers, response.text)
        detail = response.json()["detail"]
        assert "one credential" in detail and "\n" not in detail and token not in detail, detail
        assert response.headers["WWW-Authenticate"] == "Bearer"
    for one in ({"X-API-Key": token}, {"Authorization": f"Bearer {token}"}):
        assert client.get("/v1/knowledge/search", params={"q": "leave"}, headers=one).status_code == 200


def test_health_fails_when_the_serving_model_cannot_serve(settings, client, conn):
    """Issue 18 (c): the database answering is not enough; the active model must be able to serve a query."""
    from psycopg import sql

    model, table = conn.execute("SELECT model_key, vector_table FROM embedding_models WHERE state = 'active'").fetchone()
    assert client.get("/health").json() == {"status": "ok", "database": "ok", "model": model,
                                            "version": client.app.version}
    # The configured query embedder (384-d) no longer matches the dimension the model is registered with:
    conn.execute(sql.SQL("TRUNCATE {}").format(sql.Identifier(table)))
    conn.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN embedding TYPE halfvec(768)").format(sql.Identifier(table)))
    conn.execute("UPDATE embedding_models SET dimensions = 768 WHERE model_key = %s", (model,))
    mismatch = client.get("/health")
    conn.execute("UPDATE embedding_models SET dimensions = 512 WHERE model_key = %s", (model,))
    registered = client.get("/health")
    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    missing = client.get("/health")
    conn.execute("UPDATE embedding_models SET state = 'retired'")
    empty = client.get("/health")
    for response, words in ((mismatch, "queries embed to 384 dimensions, the model is registered with 768"),
                            (registered, "registered with 512 dimensions, its vector table holds 768"),
                            (missing, f"vector table {table} is missing"), (empty, "knowledge base is empty")):
        assert response.status_code == 503 and response.json()["status"] == "unavailable", response.text
        assert response.json()["database"] == "ok" and words in response.json()["problem"], response.text
