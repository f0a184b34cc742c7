"""The model backfill on a real distributed engine: a dask.distributed scheduler and two workers, each a process
of its own, run the reembed job's 16 hash shards through dagster-dask, on a Dagster instance kept in PostgreSQL
(what several machines would share)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import pytest

from bench.dagster_runs import dask_cluster as cluster
from bench.dagster_runs import free_port, kb_instance
from pipelines.ingest.embed import missing_by_shard
from pipelines.ingest.run import ingest
from pipelines.models.embedders import TorchEmbedder
from pipelines.settings import SAMPLES_DIR, load_settings
from pipelines.sources.declarations import add_source, declare
from pipelines.storage.vectors import active_model, table_name

BIN = Path(sys.executable).parent


@pytest.fixture
def dask_cluster(tmp_path):
    """start(workers) -> (scheduler address, worker pids): bench's cluster, started with the test's environment as
    it is when called, stopped at the end."""
    with ExitStack() as stack:
        yield lambda workers: stack.enter_context(cluster(workers, os.environ.copy(), tmp_path / "dask-logs"))


def deploy(settings, tmp_path, monkeypatch, dask_cluster) -> list[int]:
    """Every process (this one, `kb`, the scheduler and two workers) sees one environment, as machines of one
    deployment would: the database, the shared instance, the new model (torch fp32) and the cluster. Returns the
    workers' pids."""
    monkeypatch.setenv("DAGSTER_HOME", str(kb_instance(tmp_path / "dagster")))
    monkeypatch.setenv("KB_EMBEDDER", "local-fp32")
    address, worker_pids = dask_cluster(workers=2)
    monkeypatch.setenv("KB_DASK_SCHEDULER", address)
    return worker_pids


def reembed() -> dict:
    out = subprocess.run([str(BIN / "kb"), "dagster", "reembed", "--json"], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    return json.loads(out.stdout)


def test_a_model_backfill_runs_its_shards_on_separate_dask_workers(conn, embedder, settings, dask_cluster, tmp_path,
                                                                   monkeypatch):
    add_source(conn, declare("samples", SAMPLES_DIR / "docs"), "tests")
    ingest(conn, embedder, load_settings(), ["samples"])  # served by the default model (int8 ONNX)
    texts = conn.execute("SELECT count(DISTINCT text_hash) FROM chunks WHERE valid_to IS NULL").fetchone()[0]

    worker_pids = deploy(settings, tmp_path, monkeypatch, dask_cluster)

    first = reembed()
    assert first["success"] and first["shards_done"] == 16
    vectors = conn.execute(f'SELECT count(*) FROM "{table_name(TorchEmbedder.model_key)}"').fetchone()[0]
    assert first["computed"] == vectors >= texts > 0
    assert missing_by_shard(conn, TorchEmbedder()) == {}  # every shard was done
    workers = {int(w.rsplit(":", 1)[1]) for w in first["workers"]}
    assert workers and workers <= set(worker_pids)  # the shards ran in the dask workers, not in this process
    assert active_model(conn) == TorchEmbedder.model_key  # then search switched to the new model

    again = reembed()
    assert again["success"] and again["shards_done"] == 16 and again["computed"] == 0  # a rerun changes nothing
    assert conn.execute(f'SELECT count(*) FROM "{table_name(TorchEmbedder.model_key)}"').fetchone()[0] == vectors
    assert active_model(conn) == TorchEmbedder.model_key


def test_a_dask_scheduler_that_does_not_answer_fails_the_run_in_one_line(settings, tmp_path, monkeypatch):
    (tmp_path / "dagster").mkdir()
    (tmp_path / "dagster" / "dagster.yaml").write_text("telemetry:\n  enabled: false\n")  # a plain instance
    monkeypatch.setenv("DAGSTER_HOME", str(tmp_path / "dagster"))
    monkeypatch.setenv("KB_DASK_SCHEDULER", f"tcp://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "2s")
    out = subprocess.run([str(BIN / "kb"), "dagster", "reembed"], capture_output=True, text=True,
                         env=os.environ.copy(), timeout=300)
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 2 and "FAILED" in lines[0], lines
    assert os.environ["KB_DASK_SCHEDULER"] in lines[1] and "Traceback" not in out.stderr


def test_a_worker_killed_mid_backfill_loses_nothing_and_the_backfill_completes(conn, embedder, settings,
                                                                               dask_cluster, tmp_path, monkeypatch):
    """SIGKILL one of two workers while shards are embedding: dask hands its shards to the other worker (or a rerun
    resumes them); in the end every live text has exactly one vector and search switched to the new model."""
    import signal

    from pipelines.settings import REPO_ROOT

    records = tmp_path / "records.jsonl"
    with open(REPO_ROOT.parent / "shared" / "datasets" / "scifact" / "corpus.jsonl") as corpus:
        records.write_text("".join(line for _, line in zip(range(400), corpus)))
    add_source(conn, declare("records", records), "tests")
    ingest(conn, embedder, load_settings(), ["records"])

    worker_pids = deploy(settings, tmp_path, monkeypatch, dask_cluster)

    run = subprocess.Popen([str(BIN / "kb"), "dagster", "reembed", "--json"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    table = table_name(TorchEmbedder.model_key)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # until the shards are under way
        if conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()[0] and \
                conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] > 0:
            break
        time.sleep(0.2)
    os.kill(worker_pids[0], signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=900)
    first = json.loads(stdout)
    if first["success"]:  # dask re-ran the dead worker's shards elsewhere: each shard is counted once
        assert first["shards_done"] == 16, first
    else:  # the run may fail with its worker; the rerun resumes what is missing
        again = reembed()
        assert again["success"] and again["computed"] > 0, (first, again)
    assert missing_by_shard(conn, TorchEmbedder()) == {}
    live = conn.execute("SELECT count(DISTINCT text_hash) FROM chunks WHERE valid_to IS NULL").fetchone()[0]
    assert conn.execute(f'SELECT count(*) FROM "{table}"').fetchone()[0] == live  # one vector per live text
    assert active_model(conn) == TorchEmbedder.model_key


def parse_heavy_folder(folder: Path, pages: int = 16) -> Path:
    """The sample documents (PDF, DOCX, PPTX, XLSX, HTML...) and `pages` generated HTML pages."""
    import shutil

    shutil.copytree(SAMPLES_DIR / "docs", folder)
    for i in range(pages):
        sections = "".join(f"<h2>Procedure {i}.{j}</h2><p>Step {j} of maintenance plan {i}: check valve {i * 7 + j},"
                           f" record the pressure and sign the log sheet {i}-{j}.</p>" for j in range(6))
        (folder / f"plan-{i:02d}.html").write_text(f"<html><body><h1>Maintenance plan {i}</h1>{sections}</body></html>")
    return folder


def files_of(folder: Path) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file()}


def live_chunks(conn, source_id: str) -> list[tuple]:
    return conn.execute("SELECT d.locator, c.ordinal, c.kind, c.text, c.section_path FROM chunks c"
                        " JOIN documents d USING (document_id) WHERE d.source_id = %s AND c.valid_to IS NULL"
                        " ORDER BY 1, 2", (source_id,)).fetchall()


def parse_notes(conn, where: str, value: str) -> dict:
    return conn.execute(f"SELECT stages -> 'parse' FROM ingest_runs WHERE {where} = %s ORDER BY run_id DESC LIMIT 1",
                        (value,)).fetchone()[0]


def test_a_refresh_through_dagster_on_dask_parses_on_the_dask_workers_and_publishes_the_same_chunks(
        conn, embedder, settings, dask_cluster, tmp_path, monkeypatch):
    add_source(conn, declare("here", parse_heavy_folder(tmp_path / "here")), "tests")
    add_source(conn, declare("spread", parse_heavy_folder(tmp_path / "spread")), "tests")
    monkeypatch.setenv("DAGSTER_HOME", str(kb_instance(tmp_path / "dagster")))
    address, worker_pids = dask_cluster(workers=2)

    out = subprocess.run([str(BIN / "kb"), "dagster", "ingest", "spread", "--dask", address, "--json"],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    run = json.loads(out.stdout)["spread"]
    assert run["success"] and run["counters"]["documents_failed"] == 0, run
    parse = parse_notes(conn, "external_run_id", run["run_id"])
    documents = len(files_of(tmp_path / "spread"))
    assert parse["counts"]["parsed"] == documents == 25
    parsed_by = {int(worker.rsplit(":", 1)[1]): count for worker, count in parse["notes"]["workers"].items()}
    assert set(parsed_by) == set(worker_pids), parsed_by  # both dask workers parsed, this machine's pool none
    assert sum(parsed_by.values()) == documents
    embed = conn.execute("SELECT stages -> 'embed' FROM ingest_runs WHERE external_run_id = %s",
                         (run["run_id"],)).fetchone()[0]
    shards_by = {int(worker.rsplit(":", 1)[1]): count for worker, count in embed["notes"]["workers"].items()}
    assert set(shards_by) <= set(worker_pids) and sum(shards_by.values()) == 16  # the 16 shards, on dask workers
    assert embed["counts"]["computed"] == run["counters"]["embeddings_computed"] > 0
    ingest(conn, embedder, load_settings(), ["here"])  # in process, the local pool: the reference
    assert live_chunks(conn, "spread") == live_chunks(conn, "here") != []  # what serves is the same


def test_a_dask_worker_killed_mid_refresh_loses_no_document(conn, embedder, settings, dask_cluster, tmp_path,
                                                            monkeypatch):
    """`kb ingest --dask`: the worker that starts parsing plan-07.html kills itself (a preload hook, so the kill
    lands mid-refresh whatever the timing); dask hands that file to the other worker and the refresh publishes
    every document."""
    folder = parse_heavy_folder(tmp_path / "docs")
    add_source(conn, declare("docs", folder), "tests")
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__PRELOAD", json.dumps([str(Path(__file__).parent / "kill_once.py")]))
    monkeypatch.setenv("KB_TEST_KILL_ON", "docs:plan-07.html")
    monkeypatch.setenv("KB_TEST_KILL_MARKER", str(tmp_path / "killed"))
    address, worker_pids = dask_cluster(workers=2)

    out = subprocess.run([str(BIN / "kb"), "ingest", "--source", "docs", "--dask", address, "--json"],
                         capture_output=True, text=True, env=os.environ.copy(), timeout=900)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert (tmp_path / "killed").exists()  # the hook fired: one worker died while it parsed plan-07.html
    dead = [pid for pid in worker_pids if not Path(f"/proc/{pid}").exists()
            or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"]
    assert len(dead) == 1, worker_pids
    summary = json.loads(out.stdout)
    assert summary["errors"] == [] and summary["documents_published"] == 25, summary
    parsed_by = parse_notes(conn, "started_by", "cli")["notes"]["workers"]
    assert sum(parsed_by.values()) == 25 and {int(w.rsplit(":", 1)[1]) for w in parsed_by} <= set(worker_pids)
    assert {row[0] for row in live_chunks(conn, "docs")} == files_of(folder)


def test_kb_ingest_with_a_dask_scheduler_that_does_not_answer_is_one_error_line(conn, settings, tmp_path,
                                                                                monkeypatch):
    folder = parse_heavy_folder(tmp_path / "docs", pages=1)
    add_source(conn, declare("docs", folder), "tests")
    monkeypatch.setenv("DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT", "2s")
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    out = subprocess.run([str(BIN / "kb"), "ingest", "--source", "docs", "--dask", address], capture_output=True,
                         text=True, env=os.environ.copy(), timeout=300)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(f"Error: the dask scheduler at {address} does not answer")


def test_a_refresh_parses_with_the_deployments_workers(settings, monkeypatch):
    from assets.executors import refresh_workers
    from pipelines.ingest.workers import Workers

    monkeypatch.delenv("KB_DASK_SCHEDULER", raising=False)
    assert refresh_workers(settings) == Workers(settings.parse_workers)
    monkeypatch.setenv("KB_DASK_SCHEDULER", "tcp://10.0.0.5:8786")  # the deployment declares its cluster
    assert refresh_workers(settings) == Workers(settings.parse_workers, dask="tcp://10.0.0.5:8786")


def _wait_for(marker: str) -> str:
    """A parse that lasts until the test creates `marker` (a file much slower than the rest), else returns at once;
    gives up after a minute, so a broken scheduler fails the test instead of hanging it."""
    if marker:
        deadline = time.monotonic() + 60
        while not Path(marker).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "waited" if Path(marker).exists() else "gave up"
    return "done"


def test_workers_take_files_as_they_free_up_and_one_slow_file_holds_up_no_other(tmp_path):
    """Results come as they finish, so the run stores them while a slow file is still parsing; files are read only
    as workers free up (a bounded window), so a share of a million files is never held in memory at once."""
    from pipelines.ingest.workers import AHEAD_PER_WORKER, isolated_map

    marker = tmp_path / "slow file may finish"
    handed_out = []

    def files():
        for i in range(40):
            handed_out.append(i)
            yield str(marker) if i == 0 else ""

    results = isolated_map(_wait_for, files(), workers=2, timeout_s=120, memory_mb=4000)
    first = [next(results) for _ in range(10)]
    assert 0 not in [i for i, _ in first], "the other files waited for the slow one"
    assert len(handed_out) <= 10 + 2 * AHEAD_PER_WORKER < 40
    marker.touch()
    rest = list(results)
    assert sorted(i for i, _ in first + rest) == list(range(40))
    assert dict(first + rest)[0] == "waited"


def test_chunking_on_two_local_workers_drafts_what_one_process_drafts(conn, embedder, tmp_path):
    """The chunk stage's batches go to the run's worker processes (the chunker is pure CPU) and come back to be
    stored as they finish: the drafts are the ones this process cuts alone."""
    from pipelines.ingest.chunk import SPREAD_FROM_BATCHES, chunk_pending
    from pipelines.ingest.extract import extract
    from pipelines.ingest.parse import parse_pending
    from pipelines.ingest.workers import where
    from pipelines.sources.declarations import load_sources

    add_source(conn, declare("docs", parse_heavy_folder(tmp_path / "docs", pages=4)), "tests")
    extract(conn, load_sources(conn))
    parse_pending(conn, workers=2)
    drafts = ("SELECT document_id, ordinal, kind, text, section_path, page_number, token_count FROM chunk_drafts"
              " ORDER BY 1, 2")
    alone = chunk_pending(conn, embedder.counter, batch_size=3)
    assert "workers" not in alone.notes  # one worker: cut in this process
    cut_here = conn.execute(drafts).fetchall()
    conn.execute("DELETE FROM chunk_drafts")
    spread = chunk_pending(conn, embedder.counter, batch_size=3, workers=2)
    assert conn.execute(drafts).fetchall() == cut_here != []
    assert spread.counts == alone.counts
    batches = -(-alone.counts["documents"] // 3)
    assert sum(spread.notes["workers"].values()) == batches and where() not in spread.notes["workers"]
    # A few batches and no pool yet (a small refresh of records, nothing parsed): starting workers would cost more
    # than the chunking; it stays in this process.
    from pipelines.ingest import workers

    workers._stop_pool()
    conn.execute("DELETE FROM chunk_drafts")
    assert batches < SPREAD_FROM_BATCHES
    small = chunk_pending(conn, embedder.counter, batch_size=3, workers=2)
    assert "workers" not in small.notes and workers._pool is None
    assert conn.execute(drafts).fetchall() == cut_here


def test_a_token_counter_travels_to_a_worker_as_what_to_build_not_as_this_machines_paths(tmp_path):
    """A dask worker on another machine has the model's package and its state folder elsewhere: the chunk stage's
    counters are sent as what to build there (they once carried this machine's absolute paths)."""
    import pickle

    from pipelines.models.tokens import TiktokenCounter, local_counter, local_model_dir

    sent = pickle.dumps(local_counter())
    assert str(local_model_dir()).encode() not in sent
    assert pickle.loads(sent).count(["valve 7 pressure"]) == local_counter().count(["valve 7 pressure"])
    openai = TiktokenCounter(tmp_path / "state" / "tiktoken")
    sent = pickle.dumps(openai)
    assert str(tmp_path).encode() not in sent
    assert pickle.loads(sent).count(["valve 7 pressure"]) == openai.count(["valve 7 pressure"])
