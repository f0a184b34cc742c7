"""kb inside a Dagster deployment that already exists (issue 30): on the deployment's instance as it is, whatever
its storage, through the plain Dagster commands and kb's own, which record on the same instance."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest

from pipelines.settings import SAMPLES_DIR

BIN = Path(sys.executable).parent


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess:
    out = subprocess.run(command, cwd=cwd, env=os.environ.copy(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (command, out.stdout[-2000:], out.stderr[-3000:])
    return out


@pytest.mark.parametrize("config", ["", None], ids=["empty dagster.yaml", "no dagster.yaml"])
def test_kb_works_on_a_plain_instance_in_dagster_home(settings, tmp_path, monkeypatch, config):
    """DAGSTER_HOME with an empty dagster.yaml, or none: Dagster's default instance, kept in DAGSTER_HOME. kb declares its
    sources' partitions there, Dagster's own CLI materializes one, `kb ingest` is recorded there as runless events,
    `kb dagster ingest` runs there; kb never rewrites the deployment's dagster.yaml."""
    home = tmp_path / "dagster_home"
    home.mkdir()
    if config is not None:
        (home / "dagster.yaml").write_text(config)
    monkeypatch.setenv("DAGSTER_HOME", str(home))
    elsewhere = tmp_path / "elsewhere"  # no ./dagster.yaml where the commands run
    elsewhere.mkdir()

    run(str(BIN / "kb"), "source", "apply", str(SAMPLES_DIR / "kb.toml"), cwd=elsewhere)
    run(str(BIN / "dagster"), "asset", "materialize", "-m", "assets.definitions", "--select",
        "group:ingestion or group:embeddings", "--partition", "faq", cwd=elsewhere)
    run(str(BIN / "kb"), "ingest", "--source", "samples", cwd=elsewhere)
    dagster_run = run(str(BIN / "kb"), "dagster", "ingest", "faq", cwd=elsewhere)
    assert "faq: run" in dagster_run.stdout and "succeeded" in dagster_run.stdout

    written = (home / "dagster.yaml").read_text() if (home / "dagster.yaml").exists() else None
    assert written == config  # the deployment's own, as it was
    with dg.DagsterInstance.get() as instance:
        assert sorted(instance.get_dynamic_partitions("sources")) == ["faq", "samples"]
        assert sorted(instance.get_materialized_partitions(dg.AssetKey("published_chunks"))) == ["faq", "samples"]
        assert [r.tags.get("dagster/partition") for r in instance.get_runs()] == ["faq", "faq"]
    assert not (settings.home / "dagster").exists()  # nothing of kb's own instance was made
