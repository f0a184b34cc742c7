"""Database tables as sources (issue 28, item 3), against a second database on the suite's PostgreSQL: rows are
documents, changed rows (by their version column) are the only ones fetched, missing ids are deletions under the
guard, and the password never comes from, or goes into, kb's declarations."""

from __future__ import annotations

import json
import uuid
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql

from cli_runs import ingest, kb
from pipelines.retrieval.search import Filters, search


@pytest.fixture
def support_db(server_url):
    """A database of the company's own, holding a tickets table: (its URL as a source location, a connection)."""
    name = f"support_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(server_url)
    url = f"postgresql://{info.get('user', 'postgres')}@{quote(info.get('host', 'localhost'), safe='')}" \
          f":{info.get('port', 5432)}/{name}"
    with psycopg.connect(url, autocommit=True) as db:
        db.execute("CREATE TABLE tickets (ticket_id int PRIMARY KEY, subject text, body text, resolution text,"
                   " product text, updated_at timestamptz NOT NULL DEFAULT now())")
        db.execute("INSERT INTO tickets (ticket_id, subject, body, resolution, product) VALUES"
                   " (1, 'Printer jams', 'The okapi printer jams on A3 paper.', 'Use the rear tray.', 'printers'),"
                   " (2, 'VPN drops', 'The VPN drops every hour.', 'Update the client to 4.2.', 'network'),"
                   " (3, 'Badge lost', 'I lost my zebra badge.', 'Security issues a new one.', 'facilities')")
        yield url, db
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def hits(conn, embedder, query: str, **filters) -> list[tuple[str, str]]:
    return [(h.document, h.content) for h in search(conn, embedder, query, 10, filters=Filters(**filters))]


def declare(tmp_path, url: str, extra: str = "") -> None:
    config = tmp_path / "kb.toml"
    config.write_text(f'[sources.tickets]\nlocation = "{url}"\ngroups = ["support"]\n{extra}\n'
                      '[sources.tickets.table]\nname = "public.tickets"\nid = "ticket_id"\ntitle = "subject"\n'
                      'text = ["body", "resolution"]\nversion = "updated_at"\nmetadata = ["product"]\n')
    kb("source", "apply", str(config))


def test_rows_are_documents_and_a_refresh_fetches_only_the_rows_that_changed(settings, conn, embedder, support_db,
                                                                             tmp_path):
    url, db = support_db
    declare(tmp_path, url)
    first = ingest()
    assert (first["documents_new"], first["documents_fetched"], first["errors"]) == (3, 3, [])
    found = hits(conn, embedder, "okapi printer jams", groups=["support"])
    assert found[0][0] == "1" and "okapi printer" in found[0][1] and "rear tray" in found[0][1]
    assert conn.execute("SELECT title FROM documents WHERE locator = '1'").fetchone()[0] == "Printer jams"
    assert not hits(conn, embedder, "okapi printer jams"), "a caller outside the source's groups reads no row"
    assert conn.execute("SELECT metadata FROM documents WHERE locator = '2'").fetchone()[0] == {"product": "network"}

    again = ingest()
    assert (again["documents_unchanged"], again["documents_fetched"]) == (3, 0)
    assert "last crawl: 3 listed, 0 fetched, 3 unchanged (3 not read: row version), 0 failed, 0 deleted" in kb("status")

    db.execute("UPDATE tickets SET resolution = 'Reinstall the client.', updated_at = now() WHERE ticket_id = 2")
    db.execute("UPDATE tickets SET updated_at = updated_at - interval '1 day' WHERE ticket_id = 3")  # a clock gone back
    db.execute("INSERT INTO tickets (ticket_id, subject, body, product) VALUES (4, 'Desk', 'Desk height.', 'facilities')")
    db.execute("DELETE FROM tickets WHERE ticket_id = 1")
    changed = ingest("--allow-deletions")
    assert (changed["documents_new"], changed["documents_changed"], changed["documents_unchanged"]) == (1, 1, 1)
    assert (changed["documents_fetched"], changed["documents_deleted"]) == (3, 1)  # 2, 3 and 4; 3's text is the same
    assert any("Reinstall" in c for _, c in hits(conn, embedder, "VPN drops client", groups=["support"]))
    assert not any(d == "1" for d, _ in hits(conn, embedder, "okapi printer jams", groups=["support"]))


def test_metadata_columns_filter_search_from_the_cli_and_the_api(settings, conn, embedder, support_db, tmp_path):
    from fastapi.testclient import TestClient

    from pipelines.serving.access import create_key
    from pipelines.serving.api import create_app

    url, db = support_db
    declare(tmp_path, url)
    ingest()
    everything = hits(conn, embedder, "problem", groups=["support"])
    assert {d for d, _ in everything} == {"1", "2", "3"}
    assert {d for d, _ in hits(conn, embedder, "problem", groups=["support"], metadata={"product": "network"})} == {"2"}
    found = json.loads(kb("search", "problem", "--group", "support", "--where", "product=network", "--json"))
    assert {c["document"] for c in found["chunks"]} == {"2"}
    assert "expected column=value" in kb("search", "problem", "--where", "product", expect=2)
    _, token = create_key(conn, "helpdesk", ["support"], "tests")
    with TestClient(create_app(settings)) as client:
        answer = client.get("/v1/knowledge/search", params={"q": "problem", "where": ["product=printers"]},
                            headers={"Authorization": f"Bearer {token}"})
        refused = client.get("/v1/knowledge/search", params={"q": "problem", "where": ["=x"]})
    assert answer.status_code == 200 and {c["document"] for c in answer.json()["chunks"]} == {"1"}, answer.text
    assert refused.status_code == 422 and "expected column=value" in refused.text


def test_a_table_that_cannot_be_read_deletes_nothing(settings, conn, embedder, support_db, tmp_path):
    url, db = support_db
    declare(tmp_path, url)
    ingest()
    db.execute("ALTER TABLE tickets RENAME TO tickets_old")
    gone = ingest("--allow-deletions", expect=3)
    assert len(gone["errors"]) == 1 and gone["errors"][0]["file"].endswith("/public.tickets")
    assert 'relation "public.tickets" does not exist' in gone["errors"][0]["reason"]
    assert gone["documents_deleted"] == 0
    assert hits(conn, embedder, "okapi printer jams", groups=["support"])


def test_a_row_with_no_id_blinds_the_crawl_and_a_repeated_id_keeps_its_last_good_version(settings, conn, embedder,
                                                                                       support_db, tmp_path):
    url, db = support_db
    config = tmp_path / "kb.toml"
    config.write_text(f'[sources.faq]\nlocation = "{url}"\npublic = true\n\n[sources.faq.table]\n'
                      'query = "SELECT ticket_id AS id, subject, body FROM tickets"\nid = "id"\ntitle = "subject"\n'
                      'text = "body"\n')
    kb("source", "apply", str(config))
    ingest()
    db.execute("ALTER TABLE tickets DROP CONSTRAINT tickets_pkey, ALTER COLUMN ticket_id DROP NOT NULL")
    db.execute("INSERT INTO tickets (ticket_id, subject, body) VALUES (NULL, 'x', 'y'), (2, 'VPN again', 'twice')")
    db.execute("DELETE FROM tickets WHERE ticket_id = 3")
    result = ingest("--allow-deletions", expect=3)
    assert {e["file"] for e in result["errors"]} == {"(no id)", "2"}
    assert result["documents_deleted"] == 0, "a crawl that cannot name every row deletes nothing"
    assert any("VPN drops every hour" in c for _, c in hits(conn, embedder, "VPN drops"))


def test_a_table_declaration_refuses_a_password_and_incomplete_columns(settings, support_db, tmp_path):
    url, _ = support_db
    with_password = url.replace("@", ":hunter2@", 1)
    refused = kb("source", "add", "t", with_password, "--public", "--table", "tickets", "--id-column", "ticket_id",
                 "--text-column", "body", expect=2)
    assert "password comes from PGPASSWORD" in refused and "hunter2" not in refused
    for sneaked in ("?pass%77ord=hunter2", "?sslpassword=hunter2"):
        refused = kb("source", "add", "t", url + sneaked, "--public", "--table", "tickets", "--id-column",
                     "ticket_id", "--text-column", "body", expect=2)
        assert "password comes from PGPASSWORD" in refused and "hunter2" not in refused, sneaked
    no_id = kb("source", "add", "t", url, "--public", "--table", "tickets", "--text-column", "body", expect=2)
    assert "table needs id" in no_id
    injected = kb("source", "add", "t", url, "--public", "--table", "tickets; DROP TABLE x", "--id-column", "ticket_id",
                  "--text-column", "body", expect=2)
    assert "give it as table or schema.table" in injected
    declared = kb("source", "add", "t", url, "--public", "--table", "tickets", "--id-column", "ticket_id",
                  "--text-column", "body")
    assert "table postgresql://" in declared and "/public.tickets" in declared
    twice = kb("source", "add", "t2", url.replace("postgres@", "someone@"), "--public", "--table", "public.tickets",
               "--id-column", "ticket_id", "--text-column", "subject", expect=2)
    assert "is the location of source 't'" in twice


def test_a_declared_query_reads_with_percent_signs_and_cannot_write(settings, conn, support_db):
    url, db = support_db
    kb("source", "add", "open", url, "--public", "--query",
       "SELECT * FROM tickets WHERE subject LIKE 'P%' -- printers only", "--id-column", "ticket_id",
       "--text-column", "body")
    assert ingest()["documents_new"] == 1
    kb("source", "add", "evil", url, "--public", "--query",
       "SELECT 1 AS id, 'x' AS body) AS a; COMMIT; BEGIN READ WRITE; DELETE FROM tickets; COMMIT;"
       " SELECT 1 AS id, 'x' AS body FROM (SELECT 1", "--id-column", "id", "--text-column", "body")
    refused = ingest("--source", "evil", expect=3)
    assert "cannot read" in refused["errors"][0]["reason"]
    assert db.execute("SELECT count(*) FROM tickets").fetchone()[0] == 3, "a declared query wrote to the table"
