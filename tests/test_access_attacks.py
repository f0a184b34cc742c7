"""Who may read what, attacked (issue 27, a hostile review of items 1-5, 7, 10-12, 14): each test is one way a
restricted document, or its statistics, could reach callers outside its groups, or a refresh could act on what it
did not see; each failed on the code reviewed and passes since its fix."""

from __future__ import annotations

import subprocess
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipelines.cli import main
from pipelines.retrieval.search import Filters, search

from test_declarations_decide import KB, PUBLIC, SECRET, found, holds_secret, kb, now, share  # noqa: F401 (share)

QUERY = "zebra bonus pool directors"


def test_a_file_link_in_a_public_source_serves_a_restricted_sources_file(conn, embedder, tmp_path):
    """Item 2. A public source declared with allow_outside_links (links leading OUTSIDE its folder, e.g. to a shared
    drive) follows a file link into a restricted source's folder and serves that file to every caller. Overlaps are
    checked on folders only (declarations, the walk's device:inode of folders), never on what a file link leads to."""
    hr, pub = tmp_path / "hr", tmp_path / "pub"
    hr.mkdir(), pub.mkdir()
    (hr / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    (pub / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (pub / "bonus.md").symlink_to(hr / "bonus.md")
    config = tmp_path / "kb.toml"
    config.write_text('[sources.hr]\nlocation = "hr"\ngroups = ["hr"]\n\n'
                      '[sources.pub]\nlocation = "pub"\npublic = true\nallow_outside_links = true\n')
    kb("source", "apply", str(config))
    refused = kb("ingest", expect=3)  # the link is one file's failure, named
    assert "pub:bonus.md" in refused and "the folder of source 'hr', which only groups hr may read" in refused
    assert holds_secret(found(conn, embedder, QUERY, ["hr"]))
    assert not holds_secret(found(conn, embedder, QUERY)), "hr's file is served to everyone through pub's link"


def _mounting(*commands: str) -> list[str]:
    """The commands run in a private mount namespace, so no mount outlives the test."""
    return ["unshare", "--mount", "--propagation", "private", "sh", "-ec", " && ".join(commands)]


def _in_namespace(*commands: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(_mounting(*commands), env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def mounts(tmp_path):
    (tmp_path / "probe-a").mkdir()
    (tmp_path / "probe-b").mkdir()
    if subprocess.run(_mounting(f"mount --bind {tmp_path / 'probe-a'} {tmp_path / 'probe-b'}"),
                      capture_output=True, timeout=60).returncode != 0:
        pytest.skip("this machine does not allow mounts in a private namespace (needs root)")


def test_a_public_source_inside_a_restricted_folder_below_a_mount_point_is_accepted_and_served(
        conn, embedder, tmp_path, mounts):
    """Item 2. `Place.holds` compares two paths only when they are on one device, so a folder below a mount point is
    never 'inside' the folder above it. A share mounted inside a restricted source's folder (hr/ on the root disk,
    hr/share a mounted share, the ordinary layout of a file server) lets anyone declare a PUBLIC source on
    hr/share/x: check_overlaps accepts it, the crawl's InsideNarrower check misses it, and hr's files are served to
    every caller."""
    hr = tmp_path / "hr"
    (hr / "share").mkdir(parents=True)
    (hr / "handbook.md").write_text("# HR handbook\n\nLeave requests go to the HR desk.\n")
    kb("source", "add", "hr", str(hr), "--group", "hr")
    added = _in_namespace(f"mount -t tmpfs kbshare {hr / 'share'}", f"mkdir {hr / 'share' / 'x'}",
                          f"printf '# Bonus pool\\n\\n{SECRET}\\n' > {hr / 'share' / 'x' / 'bonus.md'}",
                          f"{KB} source add open {hr / 'share' / 'x'} --public",
                          f"{KB} ingest --json")
    assert added.returncode != 0 and "lies inside 'hr'" in added.stderr, (
        "a public source was declared inside the restricted source 'hr' (below a mount point):\n" + added.stdout)
    assert not holds_secret(found(conn, embedder, QUERY))


def test_a_bind_mount_of_a_restricted_sources_subfolder_is_served_by_the_public_source(
        conn, embedder, tmp_path, mounts):
    """Item 2. The walk compares each folder's device:inode with other sources' ROOTS only. A bind mount of any
    folder BELOW a restricted source's root (hr/payroll) inside a public source's folder is crawled as the public
    source's own: its files are served to every caller. (Its place, device + path in the filesystem from
    mountinfo, says it is hr/payroll; the walk never asks.)"""
    pub, hr = tmp_path / "pub", tmp_path / "hr"
    (pub / "payroll").mkdir(parents=True)
    (hr / "payroll").mkdir(parents=True)
    (pub / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (hr / "payroll" / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    kb("source", "add", "pub", str(pub), "--public")
    kb("source", "add", "hr", str(hr), "--group", "hr")
    out = _in_namespace(f"mount --bind {hr / 'payroll'} {pub / 'payroll'}", f"{KB} ingest --json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert holds_secret(found(conn, embedder, QUERY, ["hr"]))
    assert not holds_secret(found(conn, embedder, QUERY)), "hr/payroll is served to everyone as pub/payroll"


def test_a_bind_mount_of_one_restricted_file_is_served_by_the_public_source(conn, embedder, tmp_path, mounts):
    """Item 2. The same for a single file bind-mounted into a public folder: it is a regular file, not a link, so it
    is opened and served to every caller. (A file's place is never compared with the restricted sources'.)"""
    pub, hr = tmp_path / "pub", tmp_path / "hr"
    pub.mkdir(), hr.mkdir()
    (pub / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (pub / "bonus.md").write_text("# Placeholder\n\nNothing here yet.\n")
    (hr / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    kb("source", "add", "pub", str(pub), "--public")
    kb("source", "add", "hr", str(hr), "--group", "hr")
    out = _in_namespace(f"mount --bind {hr / 'bonus.md'} {pub / 'bonus.md'}", f"{KB} ingest --json")
    assert out.returncode == 0, out.stdout + out.stderr
    assert not holds_secret(found(conn, embedder, QUERY)), "hr/bonus.md is served to everyone as pub/bonus.md"


def test_restricting_a_folder_below_a_mount_point_hides_nothing_until_the_public_source_is_crawled_again(
        conn, embedder, tmp_path, mounts):
    """Item 3. The same blind spot the other way round: pub/ on the root disk, pub/share a mounted share holding
    hr/. Declaring the restricted source hr on pub/share/hr neither moves pub's documents there (_claim_documents:
    `below` across devices is None) nor records coverage, so the secret stays public, live and as of any time,
    until pub's next crawl happens to walk into it (and forever as of a time if pub is removed first)."""
    pub = tmp_path / "pub"
    (pub / "share").mkdir(parents=True)
    (pub / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    share = pub / "share"
    out = _in_namespace(f"mount -t tmpfs kbshare {share}", f"mkdir {share / 'hr'}",
                        f"printf '# Bonus pool\\n\\n{SECRET}\\n' > {share / 'hr' / 'bonus.md'}",
                        f"{KB} source add pub {pub} --public", f"{KB} ingest --json",
                        f"{KB} source add hr {share / 'hr'} --group hr")
    assert out.returncode == 0, out.stdout + out.stderr
    moved = conn.execute("SELECT count(*) FROM documents WHERE source_id = 'hr'").fetchone()[0]
    assert not holds_secret(found(conn, embedder, QUERY)), f"still public after hr was declared ({moved} moved)"


def test_migration_015_leaves_source_coverage_empty_so_old_history_of_a_restricted_folder_stays_public(
        settings, tmp_path):
    """Items 3 and sql/015 on an existing database. Before 015 a restricted source could already be declared inside
    a public one; the public source's own versions of the files there (crawled before the restriction) were merely
    soft-deleted, so its history of them stays. 015 creates source_coverage EMPTY and nothing fills it at migration:
    until some later declaration change or crawl of the outer source happens to call refresh_coverage, every
    caller reads those versions as of a past time (for a removed outer source, never re-crawled, until any
    unrelated `kb source add`)."""
    import numpy as np
    import psycopg

    from pipelines.storage.database import connect
    from pipelines.storage.migrations import migrate
    from pipelines.storage.vectors import ensure_vector_store
    from tests.test_migrations import _migrations_through

    data = tmp_path / "data"
    (data / "hr").mkdir(parents=True)
    with psycopg.connect(settings.database_url, autocommit=True) as raw:
        migrate(raw, _migrations_through(tmp_path, 14))
        raw.execute("INSERT INTO sources (source_id, kind, location) VALUES ('pub', 'folder', %s)", (str(data),))
        raw.execute("INSERT INTO sources (source_id, kind, location, allowed_groups) VALUES"
                    " ('hr', 'folder', %s, ARRAY['hr'])", (str(data / "hr"),))
        for locator, text, valid_to, deleted in (("hr/bonus.md", SECRET, "2026-02-01", "2026-02-01"),
                                                  ("canteen.md", PUBLIC, None, None)):
            document = raw.execute("INSERT INTO documents (source_id, locator, doc_format, size_bytes, content_hash,"
                                   " deleted_at) VALUES ('pub', %s, 'md', 1, %s, %s) RETURNING document_id",
                                   (locator, locator, deleted)).fetchone()[0]
            raw.execute("INSERT INTO chunks (document_id, ordinal, kind, text, embed_prefix, text_hash, section_path,"
                        " token_count, chunker_version, enrich_version, valid_from, valid_to)"
                        " VALUES (%s, 0, 'text', %s, '', %s, '{}', 12, 'c', 'e', '2026-01-01', %s)",
                        (document, text, locator, valid_to))
        migrate(raw)
        coverage = raw.execute("SELECT count(*) FROM source_coverage").fetchone()[0]
    with connect(settings) as conn:
        ensure_vector_store(conn, "none:4", 4)
        hits = search(conn, None, QUERY, 5, arm="lexical", vector=np.zeros(4, dtype=np.float32), model_key="none:4",
                      filters=Filters(as_of=datetime(2026, 1, 15, tzinfo=timezone.utc)))
    assert not any("zebra" in h.content for h in hits), f"source_coverage rows after 015: {coverage}"


def test_as_of_bm25_statistics_count_documents_the_caller_may_not_read(conn, embedder, tmp_path):
    """Item 3 / docs "What a caller sees never depends on documents it cannot see". A removed source's history
    keeps its readers; the part of it a restricted source now covers is hidden, but its chunks stay in that
    source's statistics history. As of a past time a caller's BM25 scores (corpus size, document frequencies)
    count the hidden documents: two callers reading identical visible text get different scores, and a caller can
    probe which words the hidden documents hold."""
    data, ctl = tmp_path / "data", tmp_path / "ctl"
    (data / "hr").mkdir(parents=True)
    ctl.mkdir()
    for folder in (data, ctl):
        (folder / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (data / "hr" / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET} The canteen okapi budget is separate.\n")
    kb("source", "add", "staff", str(data), "--group", "staff")
    kb("source", "add", "ctl", str(ctl), "--group", "ctl")
    kb("ingest")
    then = now(conn)
    kb("source", "remove", "staff")
    kb("source", "remove", "ctl")
    kb("source", "add", "hr", str(data / "hr"), "--group", "hr")

    def scores(groups):
        return [(h.document, round(h.lexical_score, 6)) for h in search(
            conn, embedder, "okapi canteen", 5, arm="lexical", filters=Filters(groups=groups, as_of=then))]

    staff, control = scores(["staff"]), scores(["ctl"])
    assert [d for d, _ in staff] == [d for d, _ in control] == ["canteen.md"]  # the same visible text, nothing else
    assert staff == control, "the hidden hr/bonus.md changes the staff caller's as-of scores"


def test_as_of_hybrid_search_reads_the_query_class_from_todays_statistics(conn, embedder, tmp_path):
    """Item 10. As-of BM25 uses the statistics of that time, but the query classifier (which sets the lexical
    weight of the fusion and `exact_first`) still reads today's lexical_terms/lexical_stats: a code that was rare
    then and is gone now makes an as-of hybrid search weigh and order results differently from how they ranked
    then. (The same live statistics weigh an as-of answer's question terms, pipelines/answers/evidence.py.)"""
    from pipelines.retrieval.search import search_explained

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "A.md").write_text("# Alarm codes\n\nThe alarm code AAA-1111 opens the east gate after hours.\n")
    (docs / "B.md").write_text("# Gates\n\nThe east gate closes at ten; the west gate at nine.\n")
    kb("source", "add", "docs", str(docs), "--public")
    kb("ingest")
    then = now(conn)
    query = "AAA-1111 east gate"
    was_class, was_hits = search_explained(conn, embedder, query, 5)
    (docs / "A.md").write_text("# Alarm codes\n\nAlarm codes are now issued by the security desk.\n")
    kb("ingest")
    as_of_class, as_of_hits = search_explained(conn, embedder, query, 5, filters=Filters(as_of=then))
    assert (as_of_class.kind, as_of_class.lexical_weight) == (was_class.kind, was_class.lexical_weight)
    assert [(h.chunk_id, round(h.score, 6)) for h in as_of_hits] == [(h.chunk_id, round(h.score, 6)) for h in was_hits]


def test_a_failed_backfill_shard_is_recorded_as_succeeded_when_a_later_shard_finishes(settings, conn, embedder,
                                                                                      share):
    """Item 14. Every shard of one backfill writes the same ingest_runs row (one Dagster run id), and each finish
    overwrites `counters` and `finished_at`: shard 0 fails (after its retries), shard 1 then succeeds, and the run
    is recorded as succeeded, its failure gone from `kb status` and the row. (Shards running side by side also set
    finished_at while others still run.)"""
    from pipelines.ingest.flow import stage
    from pipelines.ingest.run import IngestRun

    kb("source", "add", "pub", str(share), "--public")
    with pytest.raises(RuntimeError):
        with IngestRun.open(conn, settings, embedder, started_by="dagster", external_run_id="backfill-1", shard="0"):
            raise RuntimeError("shard 0: the embedding endpoint refused every batch")
    with IngestRun.open(conn, settings, embedder, started_by="dagster", external_run_id="backfill-1",
                        shard="1") as run:
        run.run_stage(stage("embed"))
    outcome = conn.execute("SELECT counters ->> 'outcome' FROM ingest_runs WHERE external_run_id = 'backfill-1'"
                           ).fetchone()[0]
    assert outcome != "succeeded", "the failed shard 0 is no longer recorded anywhere"


def test_a_backfill_with_no_declared_source_fails_from_its_second_shard(settings, conn, embedder):
    """Item 14. Shards share one ingest_runs row; with no source declared (a fresh deployment switching its model
    before declaring sources, or every source removed) the second shard's upsert sets `sources` to
    array_agg(nothing) = NULL and dies on the NOT NULL constraint: the backfill job fails for a reason that has
    nothing to do with it."""
    from pipelines.ingest.flow import stage
    from pipelines.ingest.run import IngestRun

    for shard in "01":
        with IngestRun.open(conn, settings, embedder, started_by="dagster", external_run_id="backfill-2",
                            shard=shard) as run:
            run.run_stage(stage("embed"))



def test_a_restricted_folder_renamed_on_disk_is_served_by_the_public_source_around_it(conn, embedder, share):
    """Item 2. Someone renames the restricted folder on the share (hr -> hr-archive). The public source's walk asks
    for the other sources' roots by their DECLARED path (os.stat(other.path)), which no longer exists, so the
    renamed folder is crawled as pub's own and hr's files are served to everyone; the root identity kb recorded for
    hr at its first crawl (sources.root_identities) is never consulted."""
    kb("source", "add", "pub", str(share), "--public")
    kb("source", "add", "hr", str(share / "hr"), "--group", "hr")
    kb("ingest")
    assert not holds_secret(found(conn, embedder, QUERY))
    (share / "hr").rename(share / "hr-archive")
    kb("ingest", "--source", "pub")
    assert not holds_secret(found(conn, embedder, QUERY)), "hr's folder, renamed, is now pub's and public"


def test_a_stale_vanished_mark_is_executed_by_a_later_run_whose_crawl_saw_nothing(settings, conn, embedder, share):
    """Item 11. A crawl that cannot see its source deletes nothing, but the publish of the same run deletes every
    document an EARLIER crawl marked vanished (a run stopped after extract, a subset run, a gate failure): here
    canteen.md was briefly missing during an extract-only run, is back on disk, and the next run, whose crawl failed
    because the share was unmounted, deletes it. The deletion rests on an observation the run did not make."""
    from pipelines.ingest.flow import stage
    from pipelines.ingest.run import IngestRun

    kb("source", "add", "pub", str(share), "--public")
    kb("ingest")
    (share / "canteen.md").rename(share.parent / "canteen.md.tmp")  # an editor saving it: briefly gone
    with IngestRun.open(conn, settings, embedder, ["pub"]) as run:
        run.run_stage(stage("extract"))  # a subset run (Dagster: materialize `extract` only), or a run killed here
    (share.parent / "canteen.md.tmp").rename(share / "canteen.md")
    share.rename(share.parent / "unmounted")  # the next refresh finds the share unmounted: its crawl sees nothing
    out = CliRunner().invoke(main, ["ingest", "--json"])
    assert "cannot crawl source" in out.output
    assert any("okapi" in c for _, _, c in found(conn, embedder, "okapi stew canteen")), \
        "canteen.md was deleted by a run that could not see the source"



@pytest.fixture
def two_files(tmp_path) -> tuple[Path, Path]:
    """A share with hr/ inside, declared by two kb.toml files, each with locations relative to itself: the
    handbook team's (pub, public, on the share) and HR's (hr, restricted, on share/hr)."""
    share = tmp_path / "share"
    (share / "hr").mkdir(parents=True)
    (share / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (share / "hr" / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    (tmp_path / "handbook").mkdir()
    (tmp_path / "teams" / "hr").mkdir(parents=True)
    handbook = tmp_path / "handbook" / "kb.toml"
    handbook.write_text('[sources.pub]\nlocation = "../share"\npublic = true\n')
    hr = tmp_path / "teams" / "hr" / "kb.toml"
    hr.write_text('[sources.hr]\nlocation = "../../share/hr"\ngroups = ["hr"]\n')
    kb("source", "apply", str(handbook))
    kb("source", "apply", str(hr))
    return handbook, hr


def test_a_run_says_an_unchanged_kb_toml_changed_when_kb_config_names_another_file(conn, two_files, monkeypatch):
    """Item 5. changed_since_applied compares EVERY declaring file's applied text with KB_CONFIG's file: with two
    kb.toml files and KB_CONFIG set to one of them, every run warns that this file "changed since it was last
    applied" although nothing changed, and tells the operator to re-apply it (a warning that is always there is a
    warning no one reads, so a real unapplied edit goes unnoticed)."""
    handbook, _ = two_files
    monkeypatch.setenv("KB_CONFIG", str(handbook))
    out = CliRunner().invoke(main, ["ingest"])
    assert out.exit_code == 0, out.output
    assert "changed since it was last applied" not in out.output


def test_kb_config_resolves_every_files_relative_locations_so_overlaps_are_missed(conn, embedder, two_files,
                                                                                  monkeypatch):
    """Item 2 with KB_CONFIG. On a host that sets KB_CONFIG to its copy of the handbook's kb.toml (as
    docs/sources-and-access.md says to), resolve_declared resolves EVERY file's relative locations against that
    file's folder, so hr's folder is looked for in the wrong place. Until then a stale source_coverage row hides
    what pub now crawls under hr/ (pub already re-crawled hr/bonus.md as its own), but the first change of pub
    applied on that host recomputes coverage from the wrong places and hr's files are served to everyone."""
    handbook, _ = two_files
    kb("ingest")
    monkeypatch.setenv("KB_CONFIG", str(handbook))
    handbook.write_text('[sources.pub]\nlocation = "../share"\npublic = true\nfreshness_hours = 12\n')
    kb("source", "apply")
    kb("ingest", "--source", "pub")
    assert not holds_secret(found(conn, embedder, QUERY)), "hr's folder is served by pub on the KB_CONFIG host"


def test_a_run_config_sets_how_many_parse_processes_the_code_location_host_forks():
    """Item 1 (low). The resource has no fields, but the executor's `multiprocess.max_concurrent` also became the
    number of local PARSE processes of the run, overriding the deployment's KB_PARSE_WORKERS: a launchpad user could
    make one refresh fork hundreds of parsers (each loads unstructured and spaCy, several hundred MB) on the host.
    Now a refresh parses with the deployment's workers whatever the run config, and Dagster's own executor runs at
    most as many step processes as the machine has cores."""
    import os

    from assets.executors import local_executor, refresh_workers
    from pipelines.settings import load_settings

    settings = load_settings()
    assert refresh_workers(settings).processes == settings.parse_workers
    resolved = local_executor.config_schema.resolve_config({"config": {"multiprocess": {"max_concurrent": 500}}})
    assert resolved.value["config"]["multiprocess"]["max_concurrent"] <= (os.cpu_count() or 1)
