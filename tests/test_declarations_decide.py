"""Who may read any version of a document is decided by today's declarations, through every alias of a path and
every version kept (issue 27, items 2-5, 7, 10, 11). Each test is one way a restricted document, or its history,
stayed readable by callers outside its groups, or one way a refresh served something no gate had checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from pipelines.cli import main
from pipelines.ingest.flow import stage
from pipelines.ingest.run import IngestRun
from pipelines.retrieval.search import Filters, search
from pipelines.serving.api import create_app

KB = str(Path(sys.executable).parent / "kb")
SECRET = "The zebra bonus pool for directors is 4.2 million EUR and is confidential."
PUBLIC = "The canteen opens at eight and serves okapi stew on Fridays."


def kb(*args: str, expect: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result.output


def now(conn):
    """The database's clock, after what was committed so far: the time an as-of read asks for."""
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def found(conn, embedder, query: str, groups=(), as_of=None, arm="hybrid", mode="chunks") -> list[tuple[str, str, str]]:
    hits = search(conn, embedder, query, 20, arm=arm, mode=mode, filters=Filters(groups=list(groups), as_of=as_of))
    return [(h.source, h.document, h.content) for h in hits]


def holds_secret(hits) -> bool:
    return any("zebra" in content for _, _, content in hits)


@pytest.fixture
def share(tmp_path) -> Path:
    """data/ with a public page and an hr/ folder holding a secret."""
    data = tmp_path / "data"
    (data / "hr").mkdir(parents=True)
    (data / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (data / "hr" / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    return data


# Item 2: a restricted folder reached by another name.

def test_a_restricted_folder_declared_through_a_link_is_not_served_by_the_public_source_around_it(
        conn, embedder, share, tmp_path):
    (tmp_path / "alias").symlink_to(share)
    config = tmp_path / "kb.toml"
    config.write_text('[sources.pub]\nlocation = "data"\npublic = true\n\n'
                      '[sources.hr]\nlocation = "alias/hr"\ngroups = ["hr"]\n')
    kb("source", "apply", str(config))
    kb("ingest")
    assert not holds_secret(found(conn, embedder, "zebra bonus pool directors"))
    assert ("hr", "bonus.md") in [(s, d) for s, d, _ in found(conn, embedder, "zebra bonus pool directors", ["hr"])]
    assert conn.execute("SELECT count(*) FROM documents WHERE source_id = 'pub' AND locator ^@ 'hr/'").fetchone()[0] == 0


def test_a_public_source_cannot_be_declared_on_a_restricted_folder_by_another_name(conn, share, tmp_path):
    (tmp_path / "alias").symlink_to(share)
    kb("source", "add", "hr", str(share / "hr"), "--group", "hr")
    same = kb("source", "add", "open", str(tmp_path / "alias" / "hr"), "--public", expect=2)
    assert "is the folder of source 'hr'" in same
    (share / "hr" / "sub").mkdir()
    inside = kb("source", "add", "open", str(tmp_path / "alias" / "hr" / "sub"), "--public", expect=2)
    assert "lies inside 'hr'" in inside


def _mounting(*commands: str) -> list[str]:
    """The commands run in a mount namespace of their own, so a bind mount never outlives the test."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-ec", " && ".join(commands)]


def _can_bind_mount(tmp_path: Path) -> bool:
    (tmp_path / "probe-a").mkdir()
    (tmp_path / "probe-b").mkdir()
    return subprocess.run(_mounting(f"mount --bind {tmp_path / 'probe-a'} {tmp_path / 'probe-b'}"),
                          capture_output=True, timeout=60).returncode == 0


def test_a_bind_mount_of_a_restricted_folder_is_found_when_declared_and_when_it_appears_later(
        conn, embedder, share, tmp_path):
    if not _can_bind_mount(tmp_path):
        pytest.skip("this machine does not allow bind mounts (needs root in a mount namespace)")
    mounted = tmp_path / "mnt" / "hr"
    mounted.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    kb("source", "add", "pub", str(share), "--public")
    kb("source", "add", "hr", str(mounted), "--group", "hr")  # an empty folder for now: nothing overlaps yet
    kb("ingest", "--source", "pub")
    assert holds_secret(found(conn, embedder, "zebra bonus pool directors"))  # public, as declared until now
    before = now(conn)
    # The share is mounted there later: pub's next crawl finds that hr/ is hr's folder.
    out = subprocess.run(_mounting(f"mount --bind {share / 'hr'} {mounted}", f"{KB} ingest --json --accept-new-root"),
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not holds_secret(found(conn, embedder, "zebra bonus pool directors"))
    assert not holds_secret(found(conn, embedder, "zebra bonus pool directors", as_of=before))
    assert holds_secret(found(conn, embedder, "zebra bonus pool directors", ["hr"]))
    # Declared while mounted: the overlap is refused for a wider source, whatever the path says.
    refused = subprocess.run(_mounting(f"mount --bind {share / 'hr'} {mounted}",
                                       f"{KB} source add open {mounted} --public"),
                             env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "is the folder of source 'hr'" in refused.stderr


# Item 3: a folder restricted after it was public.

def test_restricting_a_folder_later_moves_its_documents_and_hides_every_version(settings, conn, embedder, share):
    kb("source", "add", "pub", str(share), "--public")
    kb("ingest")
    when_public = now(conn)
    kb("source", "add", "hr", str(share / "hr"), "--group", "hr")
    out = json.loads(kb("ingest", "--json"))  # no --allow-deletions: nothing of pub vanished, it moved
    assert out["documents_deleted"] == 0 and not out["errors"], out
    query = "zebra bonus pool directors"
    for as_of in (None, when_public):
        assert not holds_secret(found(conn, embedder, query, as_of=as_of)), as_of
        assert not holds_secret(found(conn, embedder, query, as_of=as_of, arm="lexical")), as_of
        assert holds_secret(found(conn, embedder, query, ["hr"], as_of=as_of)), as_of
        assert any("okapi" in c for _, _, c in found(conn, embedder, "okapi stew canteen", as_of=as_of))
    history = json.loads(kb("history", "hr:bonus.md", "--json"))
    assert [v["event"] for v in history] == ["published", "moved"]  # its history moved with it
    hr_chunk = conn.execute("SELECT c.chunk_id FROM chunks c JOIN documents d USING (document_id)"
                            " WHERE d.source_id = 'hr' AND c.kind <> 'card' LIMIT 1").fetchone()[0]
    with TestClient(create_app(settings)) as client:
        for as_of in (None, when_public.isoformat()):
            params = {"q": query, "k": 20, "debug": True, "mode": "qa_first", **({"as_of": as_of} if as_of else {})}
            searched = client.get("/v1/knowledge/search", params=params).json()
            assert not any("zebra" in c["content"] for c in searched["chunks"])
            answered = client.post("/v1/knowledge/answer", json={"question": "How large is the zebra bonus pool?",
                                                                  **({"as_of": as_of} if as_of else {})}).json()
            assert "4.2" not in json.dumps(answered)
        cited = client.post("/v1/citations/validate", json={
            "claims": [{"text": "The bonus pool is 4.2 million EUR.", "citations": [hr_chunk]}],
            "retrieved": [hr_chunk]}).json()
        assert cited["citations"][0]["status"] == "INVALID" and cited["citations"][0]["similarity"] is None


def test_a_removed_public_source_keeps_no_path_that_a_restricted_source_now_covers(conn, embedder, share):
    kb("source", "add", "pub", str(share), "--public")
    kb("ingest")
    when_public = now(conn)
    kb("source", "remove", "pub")
    kb("source", "add", "hr", str(share / "hr"), "--group", "hr")
    assert not holds_secret(found(conn, embedder, "zebra bonus pool directors", as_of=when_public))
    assert any("okapi" in c for _, _, c in found(conn, embedder, "okapi stew canteen", as_of=when_public))


# Item 4: a name used again.

def test_a_name_used_again_is_a_new_source_and_the_old_history_keeps_its_readers(conn, embedder, tmp_path):
    old, new = tmp_path / "dirA", tmp_path / "dirB"
    old.mkdir(), new.mkdir()
    (old / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    (new / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    kb("source", "add", "sec", str(old), "--group", "sec")
    kb("ingest")
    when_restricted = now(conn)
    kb("source", "remove", "sec")
    kb("source", "add", "sec", str(new), "--public")
    out = json.loads(kb("ingest", "--json"))  # a new source: no recorded root to refuse it
    assert not out["errors"] and out["documents_new"] == 1, out
    query = "zebra bonus pool directors"
    assert not holds_secret(found(conn, embedder, query, as_of=when_restricted))
    assert holds_secret(found(conn, embedder, query, ["sec"], as_of=when_restricted))
    assert not holds_secret(found(conn, embedder, query, ["sec"]))  # removed: served to no one now


# Item 5: who may read a source declared from the CLI, and names in the kb.toml at hand.

def test_a_source_declared_from_the_cli_says_who_may_read_it(conn, share):
    refused = kb("ingest", str(share), expect=2)
    assert "needs to say who may read it: add --group G (repeatable) or --public" in refused
    assert conn.execute("SELECT count(*) FROM sources").fetchone()[0] == 0


def test_a_name_in_the_kb_toml_at_hand_is_never_taken_for_a_folder(conn, tmp_path, monkeypatch):
    (tmp_path / "legal").mkdir()
    (tmp_path / "legal" / "nda.md").write_text("# NDA\n\nThe non-disclosure agreement lasts five years.\n")
    (tmp_path / "kb.toml").write_text('[sources.legal]\nlocation = "legal"\ngroups = ["legal"]\n')
    monkeypatch.chdir(tmp_path)
    refused = kb("ingest", "legal", expect=2)
    assert "'legal' is a source declared in" in refused and "kb source apply" in refused
    assert conn.execute("SELECT count(*) FROM sources").fetchone()[0] == 0
    kb("source", "apply")
    kb("ingest", "legal")  # now the declared source, as the file says
    assert conn.execute("SELECT allowed_groups FROM sources WHERE source_id = 'legal'").fetchone()[0] == ["legal"]


def test_kb_source_apply_applies_all_or_nothing(conn, share, tmp_path):
    kb("source", "add", "cli", str(share / "hr"), "--group", "hr")
    (tmp_path / "other").mkdir()
    config = tmp_path / "kb.toml"
    config.write_text('[sources.other]\nlocation = "other"\npublic = true\n\n'
                      f'[sources.cli]\nlocation = "{share / "hr"}"\ngroups = ["hr"]\n')
    refused = kb("source", "apply", str(config), expect=2)
    assert "already declared from the CLI" in refused and "nothing of this file was applied" in refused
    assert [r[0] for r in conn.execute("SELECT source_id FROM sources ORDER BY 1")] == ["cli"]


def test_a_run_says_when_its_kb_toml_changed_since_it_was_applied(conn, share, tmp_path):
    config = tmp_path / "kb.toml"
    config.write_text('[sources.pub]\nlocation = "data"\npublic = true\n')
    kb("source", "apply", str(config))
    result = CliRunner().invoke(main, ["ingest"])
    assert result.exit_code == 0 and "changed since it was last applied" not in result.output
    config.write_text('[sources.pub]\nlocation = "data"\ngroups = ["staff"]\n')
    result = CliRunner().invoke(main, ["ingest"])
    assert result.exit_code == 0
    assert f"{config} changed since it was last applied: this run uses the declarations as applied" in result.output


# Item 7: a source the caller may not read, as of a time.

def test_an_unreadable_source_is_not_found_as_of_a_time_either(settings, conn, share):
    kb("source", "add", "hr", str(share / "hr"), "--group", "hr")
    kb("ingest")
    with TestClient(create_app(settings)) as client:
        for params in ({}, {"as_of": now(conn).isoformat()}, {"as_of": "2001-01-01T00:00:00Z"}):
            live = client.get("/v1/knowledge/search", params={"q": "bonus", "source_id": "hr", **params})
            nosuch = client.get("/v1/knowledge/search", params={"q": "bonus", "source_id": "nosuch", **params})
            assert live.status_code == nosuch.status_code == 404, (params, live.text)
            assert live.json()["detail"].replace("'hr'", "X") == nosuch.json()["detail"].replace("'nosuch'", "X")
            answer = client.post("/v1/knowledge/answer", json={"question": "bonus?", "source_id": "hr", **params})
            assert answer.status_code == 404


# Item 10: as-of lexical search reads history with the statistics of its time.

def test_as_of_lexical_search_finds_rewritten_and_deleted_text_and_ranks_as_it_did(conn, embedder, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "A.md").write_text("# Alarm codes\n\nThe alarm code AAA-1111 opens the east gate after hours.\n")
    (docs / "B.md").write_text("# Gates\n\nThe east gate closes at ten; the west gate at nine.\n")
    (docs / "C.md").write_text("# Keys\n\nKeys to the east gate are kept by the night porter.\n")
    kb("source", "add", "docs", str(docs), "--public")
    kb("ingest")
    then = now(conn)
    queries = ("AAA-1111", "east gate", "night porter keys")
    ranked_then = {q: [(h.chunk_id, round(h.lexical_score, 6)) for h in search(
        conn, embedder, q, 10, arm="lexical")] for q in queries}
    (docs / "A.md").write_text("# Alarm codes\n\nAlarm codes are now issued by the security desk.\n")
    (docs / "C.md").unlink()
    (docs / "D.md").write_text("# East gate\n\nThe east gate east gate east gate is being repainted.\n")
    kb("ingest", "--allow-deletions")
    assert found(conn, embedder, "AAA-1111", arm="lexical") == []
    for query in queries:
        as_of = [(h.chunk_id, round(h.lexical_score, 6)) for h in search(
            conn, embedder, query, 10, arm="lexical", filters=Filters(as_of=then))]
        assert as_of == ranked_then[query], query
    hybrid = search(conn, embedder, "AAA-1111", 5, filters=Filters(as_of=then))
    assert hybrid and "AAA-1111" in hybrid[0].content and hybrid[0].lexical_score > 0


# Item 11: a refresh is one snapshot, checked by the gate whenever what serves changes.

def test_a_renamed_file_is_served_until_the_refresh_publishes(settings, conn, embedder, share):
    kb("source", "add", "pub", str(share), "--public")
    kb("ingest")
    (share / "canteen.md").rename(share / "food.md")
    with IngestRun.open(conn, settings, embedder, ["pub"]) as run:
        run.run_stage(stage("extract"))
        served = {d for _, d, c in found(conn, embedder, "okapi stew canteen") if "okapi" in c}
        assert served == {"canteen.md"}, "extract deleted the old name before the new one was published"
        for name in ("parse", "chunk", "enrich", "embed", "publish"):
            run.run_stage(stage(name))
    assert {d for _, d, c in found(conn, embedder, "okapi stew canteen") if "okapi" in c} == {"food.md"}


def test_a_refresh_that_only_deletes_passes_the_golden_set_gate(conn, embedder, share, tmp_path):
    golden = tmp_path / "golden.jsonl"
    golden.write_text(json.dumps({"query": "okapi stew canteen", "document": "canteen.md"}) + "\n")
    config = tmp_path / "kb.toml"
    config.write_text(f'[sources.pub]\nlocation = "data"\npublic = true\ngolden_set = "{golden}"\n'
                      'max_deletion_share = 1.0\n')
    kb("source", "apply", str(config))
    kb("ingest")
    (share / "canteen.md").unlink()
    stopped = CliRunner().invoke(main, ["ingest", "--json"])
    assert stopped.exit_code == 4, stopped.output  # the gate ran on the deletion and stopped it
    assert {d for _, d, c in found(conn, embedder, "okapi stew canteen") if "okapi" in c} == {"canteen.md"}


def test_statistics_as_of_each_refresh_are_those_read_live_then(conn, embedder, tmp_path):
    """Each refresh changes the statistics in many statements, and each term's latest change waits on its row until
    a later transaction changes it (sql/functions/lexical.sql): read as of the time after each refresh, every term's
    document frequency and postings, and the corpus size, are what a live read gave then."""
    docs = tmp_path / "docs"
    docs.mkdir()
    kb("source", "add", "docs", str(docs), "--public")
    versions = [{"a.md": "Gate codes are issued weekly.", "b.md": "The east gate closes at ten."},
                {"a.md": "Gate codes are issued daily by the desk.", "c.md": "Porters keep the east gate keys."},
                {"c.md": "Porters keep the gate keys.", "d.md": "Gate gate gate repainting."}]
    terms = ["gate", "code", "east", "porter", "key", "desk"]
    seen = []
    for files in versions:
        for old in docs.iterdir():
            old.unlink()
        for name, text in files.items():
            (docs / name).write_text(f"# {name}\n\n{text}\n")
        kb("ingest", "--allow-deletions")
        keys = [conn.execute("SELECT source_key FROM sources WHERE source_id = 'docs'").fetchone()[0]]
        live = conn.execute("SELECT term, df, postings FROM kb_term_stats(%s, %s, NULL) WHERE postings > 0"
                            " ORDER BY 1", (terms, keys))
        seen.append((now(conn), keys, live.fetchall(),
                     conn.execute("SELECT kb_readable_chunks(%s, NULL)", (keys,)).fetchone()[0]))
    for when, keys, live, chunks in seen:
        assert conn.execute("SELECT term, df, postings FROM kb_term_stats(%s, %s, %s) WHERE postings > 0"
                            " ORDER BY 1", (terms, keys, when)).fetchall() == live, when
        assert conn.execute("SELECT kb_readable_chunks(%s, %s)", (keys, when)).fetchone()[0] == chunks
