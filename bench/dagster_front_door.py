"""The plain Dagster way against kb's own CLI, as processes a user starts (start-up included), on the bundled samples:

- a source's first ingest and its no-op refresh: `kb ingest --source samples` vs `dagster asset materialize -m
  assets.definitions --select 'group:ingestion or group:embeddings' --partition samples` (what the UI's
  "Materialize" runs, in process), each on a fresh KB_HOME;
- a backfill of every partition with nothing changed: the single run a BackfillPolicy.single_run backfill launches
  (`dagster asset materialize ... --partition-range faq...samples`);
- a backfill over 10 sources (10 copies of the FAQ), first and with nothing changed, as the one run a UI backfill
  launches, against `kb ingest` of the same 10 sources;
- `kb dagster ingest` (one run per source) and a `kb dagster reembed` with nothing to do.

    .venv/bin/python -m bench.dagster_front_door [--repeat 3]

The int8 model is exported once into a shared cache before the clock starts (KB_MODEL_CACHE), so first ingests
time the pipeline, not the one-time export. Writes bench/results/dagster_front_door.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]
SELECT = ["--select", "group:ingestion or group:embeddings"]


def timed(*command: str, env: dict) -> float:
    started = time.perf_counter()
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    elapsed = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({out.returncode}): {out.stdout[-2000:]}{out.stderr[-3000:]}")
    return elapsed


def fresh_env(home: Path, cache: Path) -> dict:
    shutil.rmtree(home, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KB_", "DAGSTER_")) and k != "DATABASE_URL"}
    return {**env, "KB_HOME": str(home), "KB_MODEL_CACHE": str(cache)}


def kb(*args: str, env: dict) -> float:
    return timed(str(BIN / "kb"), *args, env=env)


def materialize(*args: str, env: dict) -> float:
    return timed(str(BIN / "dagster"), "asset", "materialize", "-m", "assets.definitions", *SELECT, *args, env=env)


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/tmp/kb-bench-front-door"))
    args = parser.parse_args()
    cache = args.root / "models"
    env = fresh_env(args.root / "warm", cache)
    kb("source", "apply", "samples/kb.toml", env=env)
    kb("ingest", "--source", "faq", env=env)  # exports the model into the shared cache, off the clock

    rows = []
    cli = fresh_env(args.root / "cli", cache)
    kb("source", "apply", "samples/kb.toml", env=cli)
    first_cli = kb("ingest", "--source", "samples", env=cli)
    noop_cli = [kb("ingest", "--source", "samples", env=cli) for _ in range(args.repeat)]

    dagster = fresh_env(args.root / "dagster", cache)
    kb("source", "apply", "samples/kb.toml", env=dagster)
    first_dagster = materialize("--partition", "samples", env=dagster)
    noop_dagster = [materialize("--partition", "samples", env=dagster) for _ in range(args.repeat)]
    rows.append({"what": "first ingest of samples", "kb ingest s": round(first_cli, 2),
                 "dagster asset materialize s": round(first_dagster, 2), "ratio": round(first_dagster / first_cli, 2)})
    rows.append({"what": "no-op refresh of samples (median)", "kb ingest s": median(noop_cli),
                 "dagster asset materialize s": median(noop_dagster),
                 "ratio": round(median(noop_dagster) / median(noop_cli), 2)})

    materialize("--partition", "faq", env=dagster)
    backfill = [materialize("--partition-range", "samples...faq", env=dagster) for _ in range(args.repeat)]
    dagster_ingest = [kb("dagster", "ingest", env=dagster) for _ in range(args.repeat)]
    reembed = [kb("dagster", "reembed", env=dagster) for _ in range(args.repeat)]
    others = {"no-change backfill of every partition, one run (median s)": median(backfill),
              "kb dagster ingest, both sources, nothing changed (median s)": median(dagster_ingest),
              "kb dagster reembed, nothing to do (median s)": median(reembed)}

    ten = fresh_env(args.root / "ten", cache)
    sources = ten_sources(args.root / "ten-sources")
    kb("source", "apply", str(sources), env=ten)
    first_ten = materialize("--partition-range", "s00...s09", env=ten)
    noop_ten = [materialize("--partition-range", "s00...s09", env=ten) for _ in range(args.repeat)]
    ten_cli = fresh_env(args.root / "ten-cli", cache)
    kb("source", "apply", str(sources), env=ten_cli)
    first_ten_cli = kb("ingest", env=ten_cli)
    noop_ten_cli = [kb("ingest", env=ten_cli) for _ in range(args.repeat)]
    rows.append({"what": "backfill over 10 sources, first", "kb ingest s": round(first_ten_cli, 2),
                 "dagster asset materialize s": round(first_ten, 2), "ratio": round(first_ten / first_ten_cli, 2)})
    rows.append({"what": "backfill over 10 sources, nothing changed (median)", "kb ingest s": median(noop_ten_cli),
                 "dagster asset materialize s": median(noop_ten),
                 "ratio": round(median(noop_ten) / median(noop_ten_cli), 2)})

    from bench.report import print_table, write_results

    print_table(rows, ["what", "kb ingest s", "dagster asset materialize s", "ratio"])
    for name, value in others.items():
        print(f"{name}: {value}")
    write_results("dagster_front_door", {"ingest": rows, **others, "runs": {
        "noop_cli": noop_cli, "noop_dagster": noop_dagster, "backfill": backfill, "dagster_ingest": dagster_ingest,
        "reembed": reembed, "noop_ten": noop_ten, "noop_ten_cli": noop_ten_cli}})


def ten_sources(folder: Path) -> Path:
    """A kb.toml declaring s00..s09, each a copy of the bundled FAQ with its own record ids."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    records = [json.loads(line) for line in (REPO / "samples" / "faq.jsonl").read_text().splitlines() if line.strip()]
    declarations = []
    for i in range(10):
        name = f"s{i:02d}"
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({**r, "_id": f"{name}-{r['_id']}"}) + "\n"
                                                      for r in records))
        declarations.append(f'[sources.{name}]\nlocation = "{name}.jsonl"\npublic = true\n')
    (folder / "kb.toml").write_text("\n".join(declarations))
    return folder / "kb.toml"


if __name__ == "__main__":
    main()
