"""POST /v1/knowledge/answer latency, warm, over real HTTP on loopback (bench/README.md).

    KB_HOME=... python -m bench.answer_latency DATASET [--questions N]

serves the knowledge base `kb eval --answers DATASET` built (its kb_eval_answers_<name> database) with uvicorn in
this process, sends 5 warm-up questions, then the first N questions of DATASET/questions.jsonl one at a time,
and prints the median and p95 of their wall-clock times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import threading
import time
from pathlib import Path


def main() -> None:
    import httpx
    import uvicorn

    from pipelines.evaluation.evaluate import latency_summary, load_answer_set
    from pipelines.serving.api import create_app
    from pipelines.settings import load_settings
    from pipelines.storage.database import database_url, ensure_database

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dataset", type=Path)
    parser.add_argument("--questions", type=int, default=200)
    args = parser.parse_args()
    name = re.sub(r"[^a-z0-9]+", "_", args.dataset.resolve().name.lower())
    settings = load_settings()
    settings = dataclasses.replace(settings, database_url=ensure_database(database_url(settings),
                                                                          f"kb_eval_answers_{name}"))
    questions = [c["question"] for c in load_answer_set(args.dataset / "questions.jsonl")][:args.questions]
    server = uvicorn.Server(uvicorn.Config(create_app(settings), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.1)
    url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}/v1/knowledge/answer"
    try:
        with httpx.Client(timeout=60) as client:
            for question in questions[:5]:
                client.post(url, json={"question": question}).raise_for_status()
            ms = []
            for question in questions:
                started = time.perf_counter()
                client.post(url, json={"question": question}).raise_for_status()
                ms.append((time.perf_counter() - started) * 1000)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    print(json.dumps({"questions": len(ms), **{k: round(v, 1) for k, v in latency_summary(ms).items()}}))


if __name__ == "__main__":
    main()
