"""What a user waits for in the first hour, as wall time of the `kb` commands they type (process start included):
one small changed Markdown file (`kb ingest`, and its parse stage), and `kb ask` against `kb search`.

    .venv/bin/python -m bench.small_change [--home /tmp/kb-bench-small] [--runs 5]

Declares a copy of the bundled samples in a fresh KB_HOME (the int8 model is exported into KB_MODEL_CACHE first,
untimed), ingests it once, then times `--runs` edits of one Markdown file and `--runs` of each query command.
Prints medians and writes bench/results/small_change.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from pipelines.settings import SAMPLES_DIR

KB = str(Path(sys.executable).parent / "kb")
QUESTION = "How many weeks of paid leave do primary caregivers get?"


def timed(*args: str, env: dict) -> tuple[float, str]:
    started = time.perf_counter()
    out = subprocess.run([KB, *args], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode not in (0, 3):
        raise SystemExit(f"kb {' '.join(args)} failed: {out.stderr}")
    return time.perf_counter() - started, out.stdout + out.stderr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", type=Path, default=Path("/tmp/kb-bench-small"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    shutil.rmtree(args.home, ignore_errors=True)
    docs = args.home / "docs"
    shutil.copytree(SAMPLES_DIR / "docs", docs)
    env = {**os.environ, "KB_HOME": str(args.home)}
    env.setdefault("KB_MODEL_CACHE", str(Path("/tmp/kb-bench-models")))
    timed("ingest", str(docs), "--source", "samples", env=env)  # the first ingest: not what is measured

    page = docs / "handbook" / "leave-policy.md"
    ingest, parse = [], []
    for run in range(args.runs):
        with page.open("a") as handle:
            handle.write(f"\nEdit {run} at {time.time()}.\n")
        seconds, output = timed("ingest", "--source", "samples", env=env)
        ingest.append(seconds)
        parse.append(float(re.search(r"parse: done, 1 in ([\d.]+) s", output).group(1)))
    ask = [timed("ask", QUESTION, env=env)[0] for _ in range(args.runs)]
    search = [timed("search", QUESTION, env=env)[0] for _ in range(args.runs)]
    result = {name: round(statistics.median(values), 2) for name, values in
              (("kb ingest, one changed .md", ingest), ("its parse stage", parse), ("kb ask", ask),
               ("kb search", search))}
    for name, seconds in result.items():
        print(f"{name:<28} {seconds:6.2f} s (median of {args.runs})")
    out = Path(__file__).parent / "results" / "small_change.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
