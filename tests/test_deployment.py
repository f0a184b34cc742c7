"""What a deployment is (its database, models, endpoints, keys, sources, cluster) comes from the deployment, never
from one run's config (issue 27, item 1). A run chooses where its steps execute and its confirmations; a run
config that tries more is refused before anything runs, and nothing changes."""

from __future__ import annotations

import dagster as dg
import pytest
from fake_openai import FakeOpenAI
from test_access import HR_SECRET, hr_folder, kb  # noqa: F401 - hr_folder is a fixture

from assets.ingestion import ingest_flow
from assets.partitions import SOURCES
from assets.resources import KnowledgeBase
from pipelines.storage.vectors import ensure_vector_store


def _nothing_ran(conn) -> None:
    assert conn.execute("SELECT count(*) FROM ingest_runs").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM embedding_models").fetchone()[0] == 0
    assert conn.execute("SELECT count(*) FROM documents").fetchone()[0] == 0


@pytest.mark.parametrize("override", [
    {"embedder_kind": "openai", "openai_base_url": "FAKE", "openai_api_key": "run-key"},
    {"embedder_kind": "openai", "openai_base_url": "FAKE"},  # would send the deployment's own OPENAI_API_KEY
    {"home": "ELSEWHERE"},
    {"database_url": "postgresql://attacker@127.0.0.1:1/kb"},
    {"golden_floor": 0.0},  # a gate lowered for one run
])
def test_a_run_config_cannot_send_chunks_or_keys_elsewhere_or_change_the_deployment(
        conn, instance, hr_folder, tmp_path, monkeypatch, override):
    monkeypatch.setenv("OPENAI_API_KEY", "the-deployments-own-key")
    kb("source", "add", "hr", str(hr_folder), "--group", "hr")
    instance.add_dynamic_partitions(SOURCES, ["hr"])
    elsewhere = tmp_path / "elsewhere"
    with FakeOpenAI() as fake:
        config = {k: fake.base_url if v == "FAKE" else str(elsewhere) if v == "ELSEWHERE" else v
                  for k, v in override.items()}
        with pytest.raises(dg.DagsterInvalidConfigError, match="unexpected config entr"):
            dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="hr",
                           run_config={"resources": {"kb": {"config": config}}})
        assert fake.batches == [] and fake.attempt_times == []  # not one chunk, not one key went there
    assert not elsewhere.exists()
    _nothing_ran(conn)
    # The deployment's own run goes on as declared.
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="hr")
    assert result.success
    assert conn.execute("SELECT model_key FROM embedding_models WHERE state = 'active'").fetchone()[0].startswith("local")


def test_a_run_may_choose_its_confirmations(conn, instance, hr_folder):
    kb("source", "add", "hr", str(hr_folder), "--group", "hr")
    instance.add_dynamic_partitions(SOURCES, ["hr"])
    result = dg.materialize([ingest_flow], resources={"kb": KnowledgeBase()}, instance=instance, partition_key="hr",
                            run_config={"ops": {"kb_ingest_flow": {"config": {
                                "allow_deletions": True, "accept_new_root": True, "retry_failed": True}}}})
    assert result.success


def test_a_run_config_cannot_name_a_dask_cluster_the_deployment_did_not_declare(conn, instance, monkeypatch):
    """A run chooses the job that runs on the deployment's cluster, never which cluster: the steps there read every
    document of a restricted source. Dagster's config check refuses the address before a run exists."""
    from assets.runs import execute

    monkeypatch.setenv("KB_DASK_SCHEDULER", "tcp://10.0.0.5:8786")
    outcome = execute("kb_reembed_on_dask", instance,
                      run_config={"execution": {"config": {"cluster": {"existing": {"address": "tcp://203.0.113.9:8786"}}}}})
    assert not outcome.success and outcome.run_id is None
    assert 'unexpected config entry "cluster"' in outcome.failure and "\n" not in outcome.failure
    assert instance.get_runs() == []
    _nothing_ran(conn)


def test_the_cluster_job_without_a_declared_cluster_fails_in_one_line(conn, instance, monkeypatch):
    from assets.runs import execute

    monkeypatch.delenv("KB_DASK_SCHEDULER", raising=False)
    outcome = execute("kb_reembed_on_dask", instance)
    assert not outcome.success and "KB_DASK_SCHEDULER is not set" in outcome.failure, outcome
    assert "\n" not in outcome.failure and "Traceback" not in outcome.failure
    assert [run.status for run in instance.get_runs()] == [dg.DagsterRunStatus.FAILURE]  # not left "started"
    _nothing_ran(conn)


def test_a_model_left_building_by_another_configuration_never_fails_a_plain_refresh(conn, embedder, hr_folder):
    """A model registered once by another configuration (a shell with KB_EMBEDDER=openai) and never finished is
    built only by its backfill: plain refreshes neither embed with it (its endpoint may be gone) nor wait for it."""
    kb("source", "add", "hr", str(hr_folder), "--group", "hr")
    kb("ingest", "--source", "hr")
    ensure_vector_store(conn, "openai:text-embedding-3-small:native", 8)  # left in state building
    (hr_folder / "salaries.md").write_text(f"# Salary bands\n\n{HR_SECRET} Band E4 starts at 300,000 EUR.\n")
    kb("ingest", "--source", "hr")
    live = [r[0] for r in conn.execute("SELECT text FROM chunks WHERE valid_to IS NULL AND kind <> 'card'")]
    assert any("E4" in text for text in live)
    states = dict(conn.execute("SELECT model_key, state FROM embedding_models").fetchall())
    assert states["openai:text-embedding-3-small:native"] == "building" and "active" in states.values()
