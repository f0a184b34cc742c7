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
    sources' partitions there, Dagster's own CLI materializes one, `kb ingest` is recorded there as runless events
    (by the `kb_cli_runs` sensor's next tick: here, one tick evaluated as the daemon would), `kb dagster ingest` runs
    there; kb never rewrites the deployment's dagster.yaml."""
    from assets.automation import cli_runs
    from assets.resources import KnowledgeBase

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
        assert instance.get_materialized_partitions(dg.AssetKey(["kb", "published_chunks"])) == {"faq"}
        tick = cli_runs(dg.build_sensor_context(instance=instance, resources={"kb": KnowledgeBase()}))
        for event in tick.asset_events:  # what the daemon does with a tick's events
            instance.report_runless_asset_event(event)
        assert sorted(instance.get_dynamic_partitions("kb_sources")) == ["faq", "samples"]
        assert sorted(instance.get_materialized_partitions(dg.AssetKey(["kb", "published_chunks"]))) == ["faq", "samples"]
        assert [r.tags.get("dagster/partition") for r in instance.get_runs()] == ["faq", "faq"]
    assert not (settings.home / "dagster").exists()  # nothing of kb's own instance was made


def users_definitions() -> dg.Definitions:
    """A team's own code location: names kb's assets, jobs and ops once had, and an executor of its own."""

    @dg.asset
    def source_documents() -> int:
        return 1

    @dg.op
    def migrate_schema() -> None: ...

    @dg.op
    def backfill_summary() -> None: ...

    @dg.job
    def housekeeping():
        migrate_schema()
        backfill_summary()

    return dg.Definitions(assets=[source_documents], executor=dg.multiprocess_executor,
                          jobs=[dg.define_asset_job("ingest", selection=[source_documents]), housekeeping])


def test_kb_joins_an_existing_code_location_under_its_prefix_and_groups(conn):
    from assets.definitions import kb_definitions

    merged = dg.Definitions.merge(users_definitions(), kb_definitions(), kb_definitions(prefix="search", group="rag"))
    dg.Definitions.validate_loadable(merged)
    graph = merged.resolve_asset_graph()
    keys = {key.to_user_string() for key in graph.get_all_asset_keys()}
    assert "source_documents" in keys and {"kb/source_documents", "search/published_chunks"} <= keys
    assert all(key.path[0] in ("kb", "search") for key in graph.get_all_asset_keys() if len(key.path) > 1)
    assert {graph.get(key).group_name for key in graph.get_all_asset_keys() if key.path[0] == "search"} == {"rag"}
    assert {graph.get(key).group_name for key in graph.get_all_asset_keys() if key.path[0] == "kb"} == {
        "ingestion", "embeddings", "maintenance"}
    assert {job.name for job in merged.jobs} >= {"ingest", "kb_ingest", "search_ingest", "search_reembed"}
    assert merged.resolve_job_def("kb_reembed").executor_def.name == "local"  # kb's jobs keep theirs
    assert merged.resolve_job_def("housekeeping").executor_def is dg.multiprocess_executor  # the team's keeps its own
    with pytest.raises(ValueError, match="letters and digits"):
        kb_definitions(prefix="kb_refresh")  # kb + refresh_x and kb_refresh + x would make the same name


def test_a_refresh_under_another_prefix_materializes_that_prefixs_assets(conn, instance):
    from assets.definitions import kb_definitions
    from pipelines.sources.declarations import add_source, declare

    add_source(conn, declare("faq", SAMPLES_DIR / "faq.jsonl"), "tests")
    instance.add_dynamic_partitions("search_sources", ["faq"])
    job = kb_definitions(prefix="search").resolve_job_def("search_ingest")
    assert job.execute_in_process(instance=instance, partition_key="faq").success
    assert instance.get_materialized_partitions(dg.AssetKey(["search", "published_chunks"])) == {"faq"}
    assert instance.get_materialized_partitions(dg.AssetKey(["kb", "published_chunks"])) == set()
    assert conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NULL").fetchone()[0] > 0


def test_kb_is_a_component_of_a_dg_project_beside_the_projects_own_assets(settings, tmp_path):
    project = tmp_path / "project"
    defs = project / "team" / "defs"
    (defs / "knowledge").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[project]\nname = "team"\nversion = "0.1"\n\n[tool.dg]\n'
                                            'directory_type = "project"\n\n[tool.dg.project]\nroot_module = "team"\n'
                                            'defs_module = "team.defs"\n')
    (project / "team" / "__init__.py").write_text("")
    (defs / "__init__.py").write_text("")
    (defs / "mine.py").write_text("import dagster as dg\n\n\n@dg.asset\ndef source_documents() -> int:\n"
                                  "    return 1\n")
    (defs / "knowledge" / "defs.yaml").write_text("type: assets.component.KnowledgeBaseComponent\n"
                                                  "attributes:\n  prefix: kb\n  group: search\n")
    code = ("import dagster as dg; from pathlib import Path;"
            " d = dg.load_from_defs_folder(path_within_project=Path('.')); dg.Definitions.validate_loadable(d);"
            " g = d.resolve_asset_graph();"
            " print(sorted(k.to_user_string() for k in g.get_all_asset_keys()));"
            " print(sorted({g.get(k).group_name for k in g.get_all_asset_keys() if k.path[0] == 'kb'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(
                             filter(None, [str(project), os.environ.get("PYTHONPATH")]))})
    assert out.returncode == 0, out.stderr[-3000:]
    keys, groups = out.stdout.strip().splitlines()
    assert "'source_documents'" in keys and "'kb/published_chunks'" in keys
    assert groups == "['search']"


def test_kb_runs_as_its_own_code_location_in_a_multi_location_workspace(settings, tmp_path):
    from pipelines.settings import REPO_ROOT

    (tmp_path / "team_assets.py").write_text("import dagster as dg\n\n\n@dg.asset\ndef source_documents() -> int:\n"
                                             "    return 1\n\n\ndefs = dg.Definitions(assets=[source_documents])\n")
    (tmp_path / "workspace.yaml").write_text(
        f"load_from:\n  - python_module:\n      module_name: team_assets\n      working_directory: {tmp_path}\n"
        f"      location_name: team\n  - python_module:\n      module_name: assets.definitions\n"
        f"      working_directory: {REPO_ROOT}\n      location_name: knowledge\n")
    out = subprocess.run([str(BIN / "dagster"), "definitions", "validate", "-w", str(tmp_path / "workspace.yaml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "DAGSTER_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "code location team" in out.stdout + out.stderr and "code location knowledge" in out.stdout + out.stderr


def test_dg_checks_the_definitions_of_the_repository_as_a_dg_project(settings, tmp_path):
    """`dg check defs` (Dagster's newer CLI, which supersedes `dagster dev` with `dg dev`) finds kb's code location
    from pyproject.toml and loads it, with no warning about the environment it runs in."""
    from pipelines.settings import REPO_ROOT

    home = tmp_path / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")
    out = subprocess.run([str(BIN / "dg"), "check", "defs"], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "DAGSTER_HOME": str(home)})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "All definitions loaded successfully" in out.stdout + out.stderr
    assert "virtual environment" not in out.stdout + out.stderr
