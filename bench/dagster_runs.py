"""Dagster runs, timed: a refresh that changes nothing, through `kb dagster ingest`; and the model backfill
(`kb dagster reembed`, int8 ONNX -> torch fp32) over a dask.distributed cluster of 1, 2 and 4 workers, and in
process (the default executor) for reference. Every executor's start-up is inside the clock: the dask cluster's
scheduler and workers start when the clock does (their start-up is also reported alone), as the multiprocess
executor's processes always did.

    .venv/bin/python -m bench.dagster_runs [--records 600] [--workers 1 --workers 2 --workers 4]

State lives in KB_HOME (default /tmp/kb-bench-dagster): one base database holding the bundled samples and the
first --records SciFact records, ingested once; each backfill runs on a fresh copy of it (CREATE DATABASE ...
TEMPLATE), so every worker count starts from the same store. Writes bench/results/dagster_runs.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

BIN = Path(sys.executable).parent
SCIFACT = Path(__file__).resolve().parents[1].parent / "shared" / "datasets" / "scifact" / "corpus.jsonl"
BASE = "kb_bench_dagster_base"


def kb(*args: str, env: dict | None = None) -> tuple[float, dict | str]:
    """Wall seconds of a `kb` command (process start included, as a user waits for it) and its output."""
    started = time.perf_counter()
    out = subprocess.run([str(BIN / "kb"), *args], capture_output=True, text=True, env=env or os.environ.copy())
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"kb {' '.join(args)} failed ({out.returncode}): {out.stdout}{out.stderr[-3000:]}")
    return elapsed, json.loads(out.stdout) if "--json" in args else out.stdout


def kb_instance(home: Path) -> Path:
    """A DAGSTER_HOME holding kb's dagster.yaml (its instance in PostgreSQL beside kb's database), as every machine
    of a deployment that shares one instance holds it. kb itself never writes into a DAGSTER_HOME."""
    import shutil

    from pipelines.settings import REPO_ROOT

    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(REPO_ROOT / "dagster.yaml", home / "dagster.yaml")
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def dask_cluster(workers: int, env: dict, logs: Path) -> Iterator[tuple[str, list[int]]]:
    """(scheduler address, worker pids): a scheduler and `workers` single-threaded workers, each a process of its
    own with `env`, logging (and spilling) under `logs`; all stopped on exit. tests/test_distributed.py uses it too."""
    from distributed import Client

    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    logs.mkdir(parents=True, exist_ok=True)
    processes = []

    def spawn(name: str, *args: str) -> subprocess.Popen:
        process = subprocess.Popen([str(BIN / "dask"), *args], stdout=open(logs / f"{name}.log", "w"),
                                   stderr=subprocess.STDOUT, env=env, cwd=logs)
        processes.append(process)
        return process

    try:
        spawn("scheduler", "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard")
        pids = [spawn(f"worker-{i}", "worker", address, "--name", f"worker-{i}", "--nthreads", "1", "--no-nanny",
                      "--no-dashboard", "--memory-limit", "0").pid for i in range(workers)]
        deadline = time.monotonic() + 120
        while True:
            try:
                with Client(address, timeout=10) as client:
                    client.wait_for_workers(workers, timeout=120)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
        yield address, pids
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:  # a worker still unwinding its model's threads
                process.kill()


def prepare_base(server: str, records: int, home: Path) -> dict:
    """The base database: samples + a SciFact slice declared and ingested by `kb dagster ingest` (once)."""
    import psycopg

    from pipelines.storage.database import ensure_database

    url = ensure_database(server, BASE)
    env = {**os.environ, "DATABASE_URL": url}
    with psycopg.connect(url, autocommit=True) as conn:
        done = conn.execute("SELECT to_regclass('bench_facts')").fetchone()[0] is not None
        if done:
            return conn.execute("SELECT facts FROM bench_facts").fetchone()[0]
    slice_path = home / f"scifact-{records}.jsonl"
    with open(SCIFACT) as corpus:
        slice_path.write_text("".join(line for _, line in zip(range(records), corpus)))
    declare = {k: v for k, v in env.items() if k != "DAGSTER_HOME"}  # `kb dagster ingest` syncs the partitions
    kb("source", "add", "samples", str(Path(__file__).resolve().parents[1] / "samples" / "docs"), "--public", env=declare)
    kb("source", "add", "scifact", str(slice_path), "--public", env=declare)
    first, runs = kb("dagster", "ingest", "--json", env=env)
    with psycopg.connect(url, autocommit=True) as conn:
        chunks = conn.execute("SELECT count(*) FROM chunks WHERE valid_to IS NULL").fetchone()[0]
        facts = {"first_ingest_s": round(first, 1), "live_chunks": chunks, "records": records,
                 "runs": {s: r["counters"] for s, r in runs.items()}}
        conn.execute("CREATE TABLE bench_facts (facts jsonb)")
        conn.execute("INSERT INTO bench_facts VALUES (%s::jsonb)", (json.dumps(facts),))
    return facts


def noop_refresh(server: str) -> dict:
    """`kb dagster ingest` on the unchanged base, three times: wall time per run of one source, start-up included."""
    from pipelines.storage.database import ensure_database

    env = {**os.environ, "DATABASE_URL": ensure_database(server, BASE)}
    times = [kb("dagster", "ingest", "samples", env=env)[0] for _ in range(3)]
    in_process = [kb("ingest", "--source", "samples", "--json", env=env)[0] for _ in range(3)]
    return {"kb_dagster_ingest_s": [round(t, 2) for t in times], "median_s": round(statistics.median(times), 2),
            "kb_ingest_s": [round(t, 2) for t in in_process], "kb_ingest_median_s": round(statistics.median(in_process), 2)}


def backfill(server: str, workers: int | None, home: Path) -> dict:
    """`kb dagster reembed` to torch fp32 on a fresh copy of the base: over `workers` dask workers, or in process
    when None."""
    import psycopg

    name = f"kb_bench_dagster_{workers or 'local'}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {name} TEMPLATE {BASE}")
    info = psycopg.conninfo.conninfo_to_dict(server)
    info["dbname"] = name
    env = {**os.environ, "DATABASE_URL": psycopg.conninfo.make_conninfo(**info), "KB_EMBEDDER": "local-fp32"}
    os.environ.update(env)
    started = time.perf_counter()  # the executor's start-up is inside the clock, as it is for a user
    if workers is None:
        startup, (_, result) = 0.0, kb("dagster", "reembed", "--json", env=env)
    else:
        with dask_cluster(workers, env, home / "dask-logs" / str(workers)) as (address, _):
            startup = time.perf_counter() - started
            _, result = kb("dagster", "reembed", "--json", "--dask", address, env=env)
    elapsed = time.perf_counter() - started
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
    return {"workers": workers or "in process", "wall_s": round(elapsed, 1), "startup_s": round(startup, 1),
            "computed": result["computed"], "shards": result["shards_done"],
            "worker_processes_used": len(result["workers"]), "chunks_per_s": round(result["computed"] / elapsed, 1)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=600)
    parser.add_argument("--workers", type=int, action="append")
    args = parser.parse_args()
    home = Path(os.environ.setdefault("KB_HOME", "/tmp/kb-bench-dagster"))
    home.mkdir(parents=True, exist_ok=True)
    if "DAGSTER_HOME" not in os.environ:  # kb's instance in PostgreSQL, shared by the dask workers
        os.environ["DAGSTER_HOME"] = str(kb_instance(home / "dagster"))
    from bench.report import print_table, write_results
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url

    server = database_url(load_settings())  # holds the embedded server for the whole benchmark
    facts = prepare_base(server, args.records, home)
    print(facts, flush=True)
    noop = noop_refresh(server)
    print(noop, flush=True)
    rows = [backfill(server, None, home)]
    print(rows[-1], flush=True)
    for workers in args.workers or [1, 2, 4]:
        rows.append(backfill(server, workers, home))
        print(rows[-1], flush=True)
    one = next((r["wall_s"] for r in rows if r["workers"] == 1), None)
    for row in rows:
        row["speed_up_vs_1"] = round(one / row["wall_s"], 2) if one else None
    print_table(rows, ["workers", "wall_s", "startup_s", "computed", "chunks_per_s", "worker_processes_used", "speed_up_vs_1"])
    write_results("dagster_runs", {"base": facts, "noop_refresh": noop, "backfill": rows})


if __name__ == "__main__":
    main()
