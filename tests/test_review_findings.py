"""Hostile review of issue 27 items 1-5, 7, 10-12, 14: each test is one way the change can be broken. Every test
here FAILS on the reviewed code (main at 5992322); the docstring says what breaks and how badly."""

from __future__ import annotations

import json
import subprocess
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fastapi.testclient import TestClient

from pipelines.cli import main
from pipelines.retrieval.search import Filters, search
from pipelines.serving.api import create_app

KB = str(Path(sys.executable).parent / "kb")
SECRET = "The zebra bonus pool for directors is 4.2 million EUR and is confidential."
PUBLIC = "The canteen opens at eight and serves okapi stew on Fridays."
QUERY = "zebra bonus pool directors"


def kb(*args: str, expect: int = 0) -> str:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == expect, result.output
    return result.output


def now(conn):
    return conn.execute("SELECT clock_timestamp()").fetchone()[0]


def found(conn, embedder, query: str, groups=(), as_of=None, arm="hybrid", mode="chunks"):
    hits = search(conn, embedder, query, 20, arm=arm, mode=mode, filters=Filters(groups=list(groups), as_of=as_of))
    return [(h.source, h.document, h.content) for h in hits]


def holds_secret(hits) -> bool:
    return any("zebra" in content for _, _, content in hits)


@pytest.fixture
def share(tmp_path) -> Path:
    data = tmp_path / "data"
    (data / "hr").mkdir(parents=True)
    (data / "canteen.md").write_text(f"# Canteen\n\n{PUBLIC}\n")
    (data / "hr" / "bonus.md").write_text(f"# Bonus pool\n\n{SECRET}\n")
    return data


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
    kb("ingest")
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
