"""The Dagster layer: definitions load without heavy imports, and the asset graph materializes in process."""

import subprocess
import sys

import dagster as dg

from assets.automation import ingest_job, source_change_sensor
from assets.definitions import defs
from assets.ingestion import ASSETS
from assets.partitions import SOURCES, sources
from assets.resources import KnowledgeBase
from pipelines.settings import SAMPLES_DIR
from pipelines.sources.declarations import add_source, declare


def declare_sources(conn, instance, **locations) -> None:
    """Declare sources in the database and give each its partition, as `kb source add` does."""
    for name, location in locations.items():
        add_source(conn, declare(name, location), "tests")
    instance.add_dynamic_partitions(SOURCES, list(locations))


def test_definitions_load_with_the_stage_lineage():
    graph = defs.resolve_asset_graph()
    keys = [a.key for a in ASSETS]
    assert set(keys) <= set(graph.get_all_asset_keys())
    for upstream, downstream in zip(keys, keys[1:]):
        assert upstream in graph.get(downstream).parent_keys
    assert defs.resolve_job_def(ingest_job.name).partitions_def == sources


def test_loading_definitions_imports_neither_torch_nor_unstructured():
    code = "import sys, assets.definitions; print(sorted(m for m in ('torch', 'unstructured', 'sentence_transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_assets_materialize_in_process_and_report_metadata(conn, instance):
    declare_sources(conn, instance, samples=SAMPLES_DIR / "docs")
    result = dg.materialize(ASSETS, resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples")
    assert result.success
    meta = {e.asset_key.path[-1]: e.step_materialization_data.materialization.metadata
            for e in result.get_asset_materialization_events()}
    assert meta["source_documents"]["seen"].value == 9
    assert meta["source_documents"]["new"].value == 9
    assert meta["parsed_elements"]["parsed"].value == 9
    assert meta["chunk_embeddings"]["computed"].value == meta["published_chunks"]["chunks_inserted"].value > 0
    assert "elapsed_s" in meta["published_chunks"]

    rerun = dg.materialize(ASSETS, resources={"kb": KnowledgeBase()}, instance=instance, partition_key="samples")
    again = {e.asset_key.path[-1]: e.step_materialization_data.materialization.metadata
             for e in rerun.get_asset_materialization_events()}
    assert again["source_documents"]["unchanged"].value == 9
    assert again["chunk_embeddings"]["computed"].value == 0
    assert again["published_chunks"]["chunks_written"].value == 0


def test_sensor_requests_a_refresh_only_for_sources_that_changed(conn, instance, samples_copy):
    declare_sources(conn, instance, samples=samples_copy, faq=SAMPLES_DIR / "faq.jsonl")
    resources = {"kb": KnowledgeBase()}
    first = source_change_sensor(dg.build_sensor_context(instance=instance, resources=resources))
    assert sorted(r.partition_key for r in first) == ["faq", "samples"]
    context = dg.build_sensor_context(instance=instance, cursor=_cursor_after(first), resources=resources)
    assert list(source_change_sensor(context)) == []
    (samples_copy / "handbook" / "new-policy.md").write_text("# New policy\n\nEffective immediately.")
    context = dg.build_sensor_context(instance=instance, cursor=_cursor_after(first), resources=resources)
    assert [r.partition_key for r in source_change_sensor(context)] == ["samples"]


def _cursor_after(requests) -> str:
    import json

    return json.dumps({r.partition_key: r.run_key.split(":", 1)[1] for r in requests}, sort_keys=True)
