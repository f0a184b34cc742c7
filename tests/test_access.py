"""Access control that cannot leak, end to end through the CLI, the API and Dagster materializations.

Each test reproduces one way restricted documents used to become readable by everyone (issue 9): re-ingesting or
refreshing a source reset its groups, a second path silently repointed a source, the API took `groups=` from the
caller, the citation validator scored hidden and closed chunks, hidden documents changed public BM25 statistics,
and a symlink exposed a file outside its source folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from assets.ingestion import ingest_flow
from assets.partitions import SOURCES
from assets.resources import KnowledgeBase
from pipelines.cli import main
from pipelines.retrieval.search import Filters, search
from pipelines.serving.api import create_app
from pipelines.sources.declarations import get_source

HR_SECRET = "Executive salary bands for the zebra programme are confidential: band E3 starts at 240,000 EUR."


def kb(*args: str, expect: int = 0) -> CliRunner:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result


@pytest.fixture
def hr_folder(tmp_path) -> Path:
    folder = tmp_path / "hr"
    (folder / "drafts").mkdir(parents=True)
    (folder / "salaries.md").write_text(f"# Salary bands\n\n{HR_SECRET}\n")
    (folder / "drafts" / "reorg.md").write_text("# Reorganisation draft\n\nThe draft reorganisation plan is secret.\n")
    return folder


def materialize(instance, source_id: str) -> dg.ExecuteInJobResult:
    if source_id not in instance.get_dynamic_partitions(SOURCES):
        instance.add_dynamic_partitions(SOURCES, [source_id])
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key=source_id)
    assert result.success
    return result


def api_contents(client: TestClient, query: str, headers: dict | None = None, **params) -> list[str]:
    response = client.get("/v1/knowledge/search", params={"q": query, "k": 20, **params}, headers=headers or {})
    assert response.status_code == 200, response.text
    return [c["content"] for c in response.json()["chunks"]]


def cli_contents(query: str, *groups: str) -> list[str]:
    args = ["search", query, "--k", "20", "--json"] + [a for g in groups for a in ("--group", g)]
    return [c["content"] for c in json.loads(kb(*args).stdout)["chunks"]]


def test_reingest_and_dagster_refresh_never_change_who_can_read_a_source(settings, hr_folder, instance):
    kb("ingest", str(hr_folder), "--source", "hr", "--group", "hr", "--exclude", "drafts/*")
    kb("ingest", str(hr_folder), "--source", "hr")  # no --group: ingests as declared, does not reset it
    materialize(instance, "hr")  # a scheduled refresh reads the declaration too
    declared = get_source_of(settings, "hr")
    assert declared.groups == ("hr",) and declared.exclude == ("drafts/*",)

    assert not any("zebra" in text for text in cli_contents("zebra salary bands"))
    assert any("zebra" in text for text in cli_contents("zebra salary bands", "hr"))
    with TestClient(create_app(settings)) as client:
        assert not any("zebra" in text for text in api_contents(client, "zebra salary bands"))
    assert not any("reorganisation" in text for text in cli_contents("draft reorganisation plan", "hr")), \
        "the declared exclude glob survived the refresh"

    widen = kb("ingest", str(hr_folder), "--source", "hr", "--group", "everyone", expect=2)
    assert "kb source update hr" in widen.output
    assert get_source_of(settings, "hr").groups == ("hr",)


def get_source_of(settings, source_id):
    from pipelines.storage.database import connect

    with connect(settings) as conn:
        return get_source(conn, source_id)


def test_a_second_path_never_repoints_a_source(settings, tmp_path, instance):
    first, second = tmp_path / "a" / "handbook", tmp_path / "b" / "handbook"
    for folder, text in ((first, "Travel is booked through the portal."), (second, "Nothing to see.")):
        folder.mkdir(parents=True)
        (folder / "travel.md").write_text(f"# Travel\n\n{text}\n")
    kb("ingest", str(first), "--public")
    refused = kb("ingest", str(second), expect=2)
    assert "handbook" in refused.output and str(first) in refused.output
    materialize(instance, "handbook")
    assert get_source_of(settings, "handbook").location == str(first)
    assert any("portal" in text for text in cli_contents("how is travel booked"))
    status = json.loads(kb("status", "--json").stdout)
    assert status["sources"][0]["documents"] == 1 and status["sources"][0]["deleted"] == 0


@pytest.fixture
def restricted_kb(settings, hr_folder, samples_copy):
    kb("ingest", str(samples_copy), "--source", "samples", "--public")
    kb("ingest", str(hr_folder), "--source", "hr", "--group", "hr")
    return settings


def test_the_api_decides_groups_from_the_key_and_a_request_can_only_narrow(restricted_kb):
    hr_key = json.loads(kb("keys", "create", "payroll", "--group", "hr", "--group", "payroll", "--json").stdout)["key"]
    plain_key = json.loads(kb("keys", "create", "intranet", "--json").stdout)["key"]
    with TestClient(create_app(restricted_kb)) as client:
        query = "zebra salary bands"
        assert not any("zebra" in t for t in api_contents(client, query))
        for headers in ({}, {"X-API-Key": plain_key}):  # asking for a group is not holding it
            response = client.get("/v1/knowledge/search", params={"q": query, "groups": "hr"}, headers=headers)
            assert response.status_code == 403 and "hr" in response.json()["detail"]
        assert any("zebra" in t for t in api_contents(client, query, headers={"X-API-Key": hr_key}))
        assert any("zebra" in t for t in api_contents(client, query, groups="hr",
                                                      headers={"Authorization": f"Bearer {hr_key}"}))
        narrowed = api_contents(client, query, groups="payroll", headers={"X-API-Key": hr_key})
        assert not any("zebra" in t for t in narrowed)
        forged = hr_key[:-4] + "AAAA"
        assert client.get("/v1/knowledge/search", params={"q": query}, headers={"X-API-Key": forged}).status_code == 401

        kb("keys", "revoke", "payroll")
        revoked = client.get("/v1/knowledge/search", params={"q": query}, headers={"X-API-Key": hr_key})
        assert revoked.status_code == 401
    stored = json.dumps(json.loads(kb("keys", "list", "--all", "--json").stdout))
    assert hr_key not in stored and hr_key.split("_", 2)[2] not in stored  # only a hash of the secret is kept


def test_a_server_can_refuse_callers_without_a_key(restricted_kb):
    with TestClient(create_app(restricted_kb, require_key=True)) as client:
        assert client.get("/v1/knowledge/search", params={"q": "leave"}).status_code == 401


def test_citations_of_hidden_or_closed_chunks_look_like_unknown_chunks(restricted_kb, samples_copy):
    from pipelines.storage.database import connect

    with connect(restricted_kb) as conn:
        hidden = conn.execute("SELECT c.chunk_id FROM chunks c JOIN documents d USING (document_id)"
                              " WHERE d.source_id = 'hr' AND c.valid_to IS NULL").fetchone()[0]
    policy = samples_copy / "handbook/leave-policy.md"
    policy.write_text(policy.read_text().replace("20 weeks", "21 weeks"))
    kb("ingest", "--source", "samples")
    with connect(restricted_kb) as conn:
        closed = conn.execute("SELECT chunk_id FROM chunks WHERE valid_to IS NOT NULL").fetchone()[0]
    claim = {"text": HR_SECRET, "citations": [hidden, closed, 99_999_999]}
    body = {"claims": [claim], "retrieved": [hidden, closed, 99_999_999]}
    with TestClient(create_app(restricted_kb)) as client:
        verdicts = client.post("/v1/citations/validate", json=body).json()["citations"]
    assert [(v["status"], v["similarity"], v["reason"]) for v in verdicts] == [("INVALID", None, "unknown chunk")] * 3
    answer = Path(restricted_kb.home) / "answer.json"
    answer.parent.mkdir(parents=True, exist_ok=True)
    answer.write_text(json.dumps(body))
    as_operator = json.loads(kb("cite", str(answer), "--group", "hr", "--json").stdout)["citations"]
    assert as_operator[0]["similarity"] is not None and as_operator[1]["reason"] == "unknown chunk"


@pytest.mark.parametrize("posting_budget", [10_000, 3])
def test_a_callers_results_do_not_depend_on_documents_it_cannot_read(settings, samples_copy, tmp_path, embedder,
                                                                    monkeypatch, posting_budget):
    """Membership, order and every score are identical with and without a restricted source present, including
    BM25 statistics, the common-term cut-off and candidate pruning (a tiny budget forces pruning), and whether or not
    the planner's statistics were gathered since (autovacuum's ANALYZE comes when it comes: a plan summing a chunk's
    term scores in another order gave scores a last bit apart)."""
    import pipelines.retrieval.search as search_module
    from pipelines.storage.database import connect

    monkeypatch.setattr(search_module, "POSTING_BUDGET", posting_budget)
    (samples_copy / "ops" / "zebra.md").write_text(
        "# Zebra crossings\n\nThe zebra crossing outside warehouse B is repainted every spring.\n")
    restricted = tmp_path / "restricted.jsonl"
    restricted.write_text("".join(json.dumps({"_id": f"r{i}", "title": f"Zebra memo {i}",
                                              "text": f"Zebra zebra zebra: restricted leave policy memo {i}."}) + "\n"
                                  for i in range(80)))
    kb("ingest", str(samples_copy), "--source", "samples", "--public")
    queries = ["zebra crossing", "parental leave policy", "zebra", "how many weeks of leave", "HR-2024-047"]

    def results(conn):
        return {q: [(h.chunk_id, h.score, h.dense_rank, h.dense_score, h.lexical_rank, h.lexical_score)
                    for h in search(conn, embedder, q, 10, filters=Filters(groups=["staff"]))] for q in queries}

    with connect(settings) as conn:
        before = results(conn)
        assert any(rank is not None for *_, rank, _ in before["zebra crossing"])
        conn.execute("ANALYZE")
        assert results(conn) == before
    kb("ingest", str(restricted), "--source", "board", "--group", "board")
    with connect(settings) as conn:
        assert results(conn) == before
        conn.execute("ANALYZE")
        assert results(conn) == before
        board = search(conn, embedder, "zebra memo", 5, filters=Filters(groups=["board"]))
        assert board and all(h.source == "board" for h in board)


def test_a_restricted_source_embedded_in_the_same_run_leaves_public_dense_scores_unchanged(
        settings, server_url, samples_copy, tmp_path, embedder):
    """Two knowledge bases with the same public documents, one also holding a restricted source ingested in the
    same run, so its texts are embedded beside the public ones: a public caller gets identical results, dense
    scores included (issue 18: int8 vectors depended on their batch-mates, a side channel)."""
    import dataclasses
    import uuid

    import psycopg
    from psycopg import sql

    from pipelines.ingest.run import ingest
    from pipelines.sources.declarations import add_source, declare
    from pipelines.storage.database import connect

    restricted = tmp_path / "restricted.jsonl"
    restricted.write_text("".join(json.dumps({"_id": f"r{i}", "title": f"Board memo {i}", "text": " ".join(
        ["The board discussed leave, safety and the warehouse budget."] * (1 + i % 9))}) + "\n" for i in range(60)))
    queries = ["parental leave policy", "how many weeks of leave", "warehouse safety", "board budget", "HR-2024-047"]

    def public_results(kb_settings, with_board: bool) -> dict:
        with connect(kb_settings) as conn:
            add_source(conn, declare("samples", samples_copy), "tests")
            if with_board:
                add_source(conn, declare("board", restricted, groups=["board"]), "tests")
            ingest(conn, embedder, kb_settings)  # one run: both sources' texts embedded together
            return {q: [(h.source, h.document, h.content, h.score, h.dense_rank, h.dense_score, h.lexical_rank,
                         h.lexical_score) for h in search(conn, embedder, q, 10, filters=Filters(groups=["staff"]))]
                    for q in queries}

    other = f"kb_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(other)))
    try:
        info = psycopg.conninfo.conninfo_to_dict(settings.database_url)
        other_settings = dataclasses.replace(settings, database_url=psycopg.conninfo.make_conninfo(**{**info, "dbname": other}))
        alone = public_results(settings, with_board=False)
        beside_board = public_results(other_settings, with_board=True)
    finally:
        with psycopg.connect(server_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(other)))
    assert all(alone[q] for q in queries) and not any(h[0] == "board" for q in queries for h in beside_board[q])
    assert beside_board == alone


def test_a_symlink_out_of_the_source_folder_is_a_per_file_error(settings, samples_copy, tmp_path, instance):
    secret = tmp_path / "outside" / "shadow.txt"
    secret.parent.mkdir()
    secret.write_text("root:$6$saltsalt$hashedpasswordzebra:19000:0:99999:7:::\n")
    (samples_copy / "ops" / "shadow.txt").symlink_to(secret)
    (samples_copy / "ops" / "escape").symlink_to(secret.parent, target_is_directory=True)

    result = kb("ingest", str(samples_copy), "--source", "samples", "--public", "--json", expect=3)
    errors = json.loads(result.stdout)["errors"]
    assert [e["file"] for e in errors] == ["ops/shadow.txt"]
    assert "is a symbolic link" in errors[0]["reason"] and str(samples_copy / "ops/shadow.txt") in errors[0]["reason"]
    assert not any("hashedpassword" in t for t in cli_contents("root password hash"))
    status = json.loads(kb("status", "--json").stdout)
    assert [f["locator"] for f in status["failures"]] == ["ops/shadow.txt"]

    refresh = materialize(instance, "samples")
    failures = {e.asset_key.path[-1]: e.step_materialization_data.materialization.metadata.get("failures")
                for e in refresh.get_asset_materialization_events()}
    assert "is a symbolic link" in failures["source_documents"].value
    with TestClient(create_app(settings)) as client:
        assert not any("hashedpassword" in t for t in api_contents(client, "root password hash zebra"))
