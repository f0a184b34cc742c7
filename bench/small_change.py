"""What a user waits for in the first hour, as wall time of the `kb` commands they type (process start included):
one small changed Markdown file (`kb ingest`, and its parse stage), and `kb ask` against `kb search`.

    .venv/bin/python -m bench.small_change [--runs 7] [--tree before=/path/to/an/older/checkout ...]

Each tree (default: this checkout) gets a fresh KB_HOME under /tmp/kb-bench-small-<name> holding a copy of the
bundled samples, ingested once (untimed; the int8 model is exported once into KB_MODEL_CACHE). Then, run by run,
the trees take turns (so that a busy shared machine slows them alike): an edit of one Markdown file and
`kb ingest`, `kb ask`, `kb search`. Prints medians per tree and writes bench/results/small_change.json.
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

KB = str(Path(sys.executable).parent / "kb")
QUESTION = "How many weeks of paid leave do primary caregivers get?"
HERE = Path(__file__).resolve().parent.parent


def timed(env: dict, *args: str) -> tuple[float, str]:
    started = time.perf_counter()
    out = subprocess.run([KB, *args], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode not in (0, 3):
        raise SystemExit(f"kb {' '.join(args)} failed: {out.stderr}")
    return time.perf_counter() - started, out.stdout + out.stderr


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                        help="a checkout to measure (repeatable; default: this one, as 'this')")
    args = parser.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree) or {"this": str(HERE)}
    envs = {}
    for name, tree in trees.items():
        home = Path(f"/tmp/kb-bench-small-{name}")
        shutil.rmtree(home, ignore_errors=True)
        shutil.copytree(HERE / "samples" / "docs", home / "docs")
        envs[name] = {**os.environ, "KB_HOME": str(home), "PYTHONPATH": tree,
                      "KB_MODEL_CACHE": os.environ.get("KB_MODEL_CACHE", "/tmp/kb-bench-models")}
        timed(envs[name], "ingest", str(home / "docs"), "--source", "samples", "--public")  # the first ingest: not measured

    times: dict[str, dict[str, list[float]]] = {name: {"ingest": [], "parse": [], "ask": [], "search": []}
                                                for name in trees}
    for run in range(args.runs):
        for name, env in envs.items():
            with (Path(env["KB_HOME"]) / "docs" / "handbook" / "leave-policy.md").open("a") as page:
                page.write(f"\nEdit {run} at {time.time()}.\n")
            seconds, output = timed(env, "ingest", "--source", "samples")
            times[name]["ingest"].append(seconds)
            times[name]["parse"].append(float(re.search(r"parse: done, 1 in ([\d.]+) s", output).group(1)))
            times[name]["ask"].append(timed(env, "ask", QUESTION)[0])
            times[name]["search"].append(timed(env, "search", QUESTION)[0])
    labels = {"ingest": "kb ingest, one changed .md", "parse": "  its parse stage", "ask": "kb ask", "search": "kb search"}
    result = {name: {what: round(statistics.median(values), 2) for what, values in measured.items()}
              for name, measured in times.items()}
    print(f"{'seconds, median of ' + str(args.runs):<28}" + "".join(f"{name:>10}" for name in trees))
    for what, label in labels.items():
        print(f"{label:<28}" + "".join(f"{result[name][what]:>10.2f}" for name in trees))
    out = HERE / "bench" / "results" / "small_change.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
